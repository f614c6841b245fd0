"""Streams and a dead engine, through a real proxy whose only engine is killed.

Killed mid-stream, the answer ends with a well-formed error event (the API's shape, OpenAI's
type names) and ``[DONE]``. Killed before the request, the client gets a plain HTTP 503 with
Retry-After and the error body, before any byte of a stream, on /v1/chat/completions and
/v1/completions, streamed or not: the openai SDK raises ``APIStatusError`` for ``stream=True``
at the call, not halfway through iterating.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support import EngineProcess, ProxyProcess

# From the engine's death to the 503, for a request sent right after it: the proxy still
# routes to the dead engine, fails to connect, waits ENGINE_WAIT_S (2 s) for another engine.
NO_ENGINE_BOUND_S = 5.0


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    started = EngineProcess(tiny_model_dir, tmp_path, "--incremental-streaming-output")
    yield started.wait_ready()
    started.stop()


@pytest.fixture
def proxy(tiny_model_dir, tmp_path, engine):
    flags = ("--engines", engine.url, "--health-interval-s", "0.5")
    with ProxyProcess(tiny_model_dir, tmp_path / "proxy", *flags) as process:
        yield process


def _kill(engine: EngineProcess) -> float:
    engine.process.kill()
    engine.process.wait(timeout=10)
    return time.monotonic()


def test_an_engine_killed_mid_stream_ends_the_stream_with_a_well_formed_error(proxy, engine):
    session = proxy.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count slowly from one to a hundred."}],
        "max_tokens": 2000,
        "temperature": 0,  # greedy: the tiny model does not stop early on this prompt
        "stream": True,
    }
    events: list = []
    url = f"{session['base_url']}/chat/completions"
    with httpx.stream("POST", url, headers=headers, json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            event = payload if payload == "[DONE]" else json.loads(payload)
            events.append(event)
            deltas = [c["delta"] for c in event["choices"]] if "choices" in event else []
            if any(d.get("content") for d in deltas) and engine.process.poll() is None:
                _kill(engine)  # the answer has begun
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert set(error) == {"error"}, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "service_unavailable", error
    assert error["error"]["code"] == "no_engine_available"
    assert all("error" not in event for event in events[:-2] if isinstance(event, dict))


REQUESTS = [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/completions", {"prompt": "hi"}),
]


@pytest.mark.parametrize(("path", "fields"), REQUESTS, ids=["chat", "completions"])
def test_with_no_engine_a_request_is_a_plain_503_before_any_byte(proxy, engine, path, fields):
    session = proxy.session()
    killed = _kill(engine)
    http = httpx.Client(
        base_url=session["base_url"],
        headers={"Authorization": f"Bearer {session['api_key']}"},
        timeout=60,
    )
    took: dict[str, float] = {}
    with http:
        for stream in (True, False):
            started = time.monotonic()
            request = {"model": "tiny", "max_tokens": 4, "stream": stream, **fields}
            with http.stream("POST", path, json=request) as reply:
                raw = reply.read()
            took[f"stream={stream}"] = round(time.monotonic() - started, 2)
            took.setdefault("first, since the kill", round(time.monotonic() - killed, 2))
            assert reply.status_code == 503, raw
            assert reply.headers["content-type"].startswith("application/json")
            assert int(reply.headers["retry-after"]) >= 1
            assert b"data:" not in raw  # not one SSE byte went out before the error
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "service_unavailable" and error["message"]
    print(f"\n{path}: 503 after (s) {took}")
    assert all(t < NO_ENGINE_BOUND_S for t in took.values()), took


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_openai_sdk_gets_a_503_at_the_call_for_a_stream(proxy, engine, api):
    session = proxy.session()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    _kill(engine)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        if api == "chat":
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
            )
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True)
    took = time.monotonic() - started
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"]
    assert raised.value.type == "service_unavailable"
    print(f"\n{api}, stream=True: the SDK raised 503 after {took:.2f} s")
    assert took < NO_ENGINE_BOUND_S
