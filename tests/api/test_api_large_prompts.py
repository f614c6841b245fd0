"""A large prompt holds no other request.

- A prompt of more characters than the context's tokens can hold (``context *
  max_chars_per_token``) is refused, 400 ``context_length_exceeded`` in the surface's shape,
  before it is tokenized: 28 MB of messages are refused in about a second (tokenizing them took
  minutes, the event loop held all along).
- A long prompt that may fit is rendered and tokenized on a prompt thread: ``/health`` answers
  all the while, in milliseconds (it waited for the whole tokenization before: seconds).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.api.api_support import NO_KEY, Api, assert_error

# 4 messages of 7.1 M characters (28.4 MB), each under the per-string bound: the request
# (7 of them) cut to fit the model routes' body limit (max_body_bytes, 32 MiB).
HUGE = ["hello world this is a prompt " * 245_000] * 4
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


def huge_request(api: Api, path: str, session: dict) -> tuple[float, dict]:
    """The seconds a 28 MB request on ``path`` took to answer, and its answer (a 400)."""
    messages = [{"role": "user", "content": text} for text in HUGE]
    if path == "/v1/responses":
        body = {"model": "tiny", "input": messages, "max_output_tokens": 1}
    else:
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
    started = time.monotonic()
    reply = api.call("POST", path, key=session["api_key"], json=body, headers=ANTHROPIC_HEADERS)
    elapsed = time.monotonic() - started
    assert reply.status_code == 400, reply.text[:500]
    return elapsed, reply.json()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_28_mb_prompt_is_refused_before_it_is_tokenized(api: Api, path: str):
    session = api.new_session()
    elapsed, answer = huge_request(api, path, session)
    if path == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["code"] == "context_length_exceeded", answer
        message = answer["error"]["message"]
    assert "characters" in message, message
    assert elapsed < 10, f"refused in {elapsed:.1f}s"  # tokenizing it took minutes
    assert api.session(session["session_id"])["turns"] == []


def test_a_28_mb_text_completion_prompt_is_refused_before_it_is_tokenized(api: Api):
    session = api.new_session()
    body = {"model": "tiny", "prompt": HUGE[0], "max_tokens": 1}
    started = time.monotonic()
    reply = api.call("POST", "/v1/completions", key=session["api_key"], json=body)
    assert_error(reply, 400, code="context_length_exceeded")
    assert time.monotonic() - started < 10


@pytest.fixture
def long_context(api: Api) -> Iterator[int]:
    """The engine reports a context of a million tokens for the test's duration (the tiny
    model's is 2,048, which no slow prompt fits), so that a long prompt is tokenized."""
    (engine,) = api.http.app.state.ctx.pool.engines
    reported = engine.context_length
    engine.context_length = 1_000_000
    try:
        yield engine.context_length
    finally:
        engine.context_length = reported


class LoopLag:
    """The longest the app's event loop went without running a task that asked to wake every
    5 ms, while ``watching``: what any request (``/health`` included) waits for at most."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.watching = True
        self.longest = 0.0

    async def watch(self) -> None:
        last = time.monotonic()
        while self.watching:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            self.longest = max(self.longest, now - last - 0.005)
            last = now

    def __enter__(self) -> LoopLag:
        self.future = self.api.http.portal.start_task_soon(self.watch)
        return self

    def __exit__(self, *exc: object) -> None:
        self.watching = False
        self.future.result(timeout=5)


def probe_health(
    api: Api, busy: Callable[[], bool], pause: float = 0.01
) -> tuple[LoopLag, list[float]]:
    """``/health`` asked every ``pause`` seconds while ``busy()``, the loop watched meanwhile:
    its lag and the answers' latencies."""
    latencies = []
    with LoopLag(api) as lag:
        while busy():
            started = time.monotonic()
            assert api.call("GET", "/health", key=NO_KEY).status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(pause)
    return lag, latencies


def test_health_answers_while_a_long_prompt_is_tokenized(api: Api, long_context: int):
    session = api.new_session()
    text = "hello world this is a prompt " * 100_000  # 2.9 M characters: seconds to tokenize
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": long_context - 1,  # refused once tokenized: it leaves no such room
    }
    answered: list[tuple[float, httpx.Response]] = []

    def long_request() -> None:
        started = time.monotonic()
        reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=body)
        answered.append((time.monotonic() - started, reply))

    with LoopLag(api) as calm:  # what this machine's scheduling alone holds the loop
        time.sleep(1.0)
    worker = threading.Thread(target=long_request)
    worker.start()
    lag, latencies = probe_health(api, worker.is_alive, pause=0.02)
    worker.join()
    ((took, reply),) = answered
    assert_error(reply, 400, code="context_length_exceeded")
    assert took > 1.0, took  # the prompt took its time
    assert len(latencies) > 20, latencies
    # Before, the loop (and /health) waited for the whole tokenization: the prompt's seconds.
    # Now the loop's steps are short (asyncio's slow-callback log: none over 42 ms). Measured
    # on 2 cores shared with other work (load 9 to 16): the loop held 110-230 ms at worst
    # (13-17 ms with no request: what a thread busy tokenizing costs the others of the
    # process on such a machine), /health 96-240 ms at worst, 3-20 ms typically.
    print(
        f"loop held {lag.longest * 1000:.0f} ms (calm: {calm.longest * 1000:.0f} ms); "
        f"/health up to {max(latencies) * 1000:.0f} ms; the prompt {took:.1f} s"
    )
    assert lag.longest < 0.5, (lag.longest, calm.longest, took)
    assert max(latencies) < 0.5, (max(latencies), calm.longest, took)


def _lag_while(
    api: Api, path: str, content: bytes, key: str
) -> tuple[float, float, httpx.Response]:
    """The longest the event loop was held and the slowest ``/health`` while ``content`` (a
    JSON body already made: making it in this process would hold the interpreter too) was
    posted to ``path``, and the answer."""
    answered: list[httpx.Response] = []
    headers = {**ANTHROPIC_HEADERS, "Content-Type": "application/json"}

    def post() -> None:
        answered.append(api.call("POST", path, key=key, content=content, headers=headers))

    worker = threading.Thread(target=post)
    worker.start()
    lag, latencies = probe_health(api, worker.is_alive)
    worker.join()
    return lag.longest, max(latencies, default=0.0), answered[0]


def _calm(api: Api, seconds: float = 1.5) -> tuple[float, float]:
    """What the machine's load alone holds the loop and ``/health`` for, measured as
    ``_lag_while`` does, with no request beside the probes."""
    until = time.monotonic() + seconds
    lag, latencies = probe_health(api, lambda: time.monotonic() < until)
    return lag.longest, max(latencies)


def test_no_body_under_the_limits_holds_the_others(api: Api):
    """The issue's freeze: one 49.7 MB request held every other client for 58 s. Each body
    here is as large or as many-objected as the door lets through, or just past it: the door's
    scans and FastAPI's parse and validation run on worker threads a piece at a time.

    Measured on 2 cores with a CI run beside it: the loop held 33-44 ms at worst (9 ms for the
    413s; 3.5 ms with no request), where it held 350 ms (28 MB) and 1.7-2.0 s (95,000 and
    190,000 messages) with the scans and the validation on the loop. The bound leaves room for
    a machine busier still."""
    session = api.new_session()
    key = session["api_key"]
    calm_held, calm_health = _calm(api)
    print(f"calm: loop held {calm_held * 1000:.0f} ms, /health up to {calm_health * 1000:.0f} ms")

    def chat(messages: list[dict], **more: object) -> bytes:
        return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 1, **more}).encode()

    one = [{"role": "user", "content": "x"}]
    huge = chat([{"role": "user", "content": text} for text in HUGE])
    over = "context_length_exceeded"
    cases = [
        ("50 MB", "/v1/chat/completions", chat(one, pad="y" * 50_000_000), 413, None),
        ("28 MB", "/v1/chat/completions", huge, 400, over),
        ("28 MB", "/v1/messages", huge, 400, None),
        ("45,000 messages", "/v1/chat/completions", chat(one * 45_000), 400, over),
        ("95,000 messages", "/v1/chat/completions", chat(one * 95_000), 413, "request_too_large"),
    ]
    for name, path, content, status, code in cases:
        # On top of what the machine's load alone holds the loop and /health (measured the
        # same way with no request: 3.5 ms and 20 ms on a calm machine, 100 ms and more at a
        # load of 15, where the fixed bound alone failed on old and new code alike). A case
        # over the bound is measured once more and the better of the two counts: work on the
        # loop holds it every time (the old code: 1.7-2.0 s, each time), while a burst of the
        # machine's other work (CI's other test worker) held it 0.9 s once, in one run of many.
        for attempt in (1, 2):
            held, health, reply = _lag_while(api, path, content, key)
            print(
                f"{name} on {path} ({attempt}): {reply.status_code}; "
                f"loop held {held * 1000:.0f} ms, /health up to {health * 1000:.0f} ms"
            )
            assert reply.status_code == status, reply.text[:300]
            if code is not None:
                assert reply.json()["error"]["code"] == code, reply.text[:300]
            if held < 0.25 + calm_held and health < 0.25 + calm_health:
                break
        assert held < 0.25 + calm_held, (name, path, held, calm_held, attempt)
        assert health < 0.25 + calm_health, (name, path, health, calm_health, attempt)
    assert api.session(session["session_id"])["turns"] == []


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", {"model": "tiny", "messages": [], "temperature": "hot"}, 400),
        ("/v1/responses", {"model": "tiny", "input": [], "max_output_tokens": -1}, 400),
        ("/v1/messages", {"model": "tiny", "messages": [], "max_tokens": "many"}, 400),
        ("/rl/sessions", {"metadata": {"a": 1}, "ttl_s": "long"}, 422),
    ],
)
def test_a_large_body_is_validated_off_the_loop_with_the_same_answer(
    api: Api, path: str, body: dict, status: int
):
    """Past 256 KiB a body is parsed and validated on a worker thread (``BodyOffLoop``): its
    answer, errors included, is what FastAPI gives a small one."""
    session = api.new_session()
    headers = {**ANTHROPIC_HEADERS, "Content-Type": "application/json"}
    answers = []
    for pad in ("", "p" * 300_000):
        content = json.dumps({**body, "zz_pad": pad} if pad else body).encode()
        reply = api.call("POST", path, key=session["api_key"], content=content, headers=headers)
        assert reply.status_code == status, reply.text[:300]
        answers.append(reply.json())
    assert answers[0] == answers[1]
    broken = b'{"model": "tiny", "messages": [' + b'"x", ' * 60_000 + b"}"
    reply = api.call("POST", path, key=session["api_key"], content=broken, headers=headers)
    assert reply.status_code == 400, reply.text[:300]
    assert "not valid JSON" in reply.text, reply.text[:300]


def test_a_body_without_a_content_type_is_answered_as_fastapi_does_whatever_its_size(api: Api):
    """FastAPI reads no JSON from a body without a content type (strict_content_type): a small
    one is refused. A large one was parsed and validated on a thread all the same and served."""
    session = api.new_session()
    answers = []
    for pad in ("", "p" * 300_000):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        content = json.dumps({**body, "user": pad} if pad else body).encode()
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        reply = api.http.post("/v1/chat/completions", content=content, headers=headers)
        answers.append((reply.status_code, reply.json()["error"]["message"]))
    assert answers[0] == answers[1] and answers[0][0] == 400, answers
