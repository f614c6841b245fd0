"""Engines that die: one SIGKILLed mid-stream behind a proxy of two, then the last one.

Two embedded engines behind one ``proxrl serve --engines``; streaming agents (the real openai
SDK, logprobs on) are cut off when one engine is killed. Each must still get one whole answer,
and what it was given token by token (the token strings, their logprobs, the count) must be
exactly the turn the store holds. Then the last engine dies too: every new request, chat or
completions, streamed or not, is answered with a plain 503 in our error shape, with Retry-After,
within ``NO_ENGINE_BOUND_S`` of asking.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from tests.support import EngineProcess, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STREAMS = 6
MAX_TOKENS = 300
ECHO_TOLERANCE = 1e-6  # a logprob sent to the client vs the one stored
# A request with no engine in rotation: the proxy waits at most 2 s for one to come back, then
# answers 503. Measured 2.0 s for each of the four kinds (it was 10 s before that bound).
NO_ENGINE_BOUND_S = 6.0


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    started = [
        EngineProcess(tiny_model_dir, logs, "--incremental-streaming-output", "--num-threads", "1")
        for _ in range(2)
    ]
    for engine in started:
        engine.wait_ready()
    yield started
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory, engines):
    urls = ",".join(engine.url for engine in engines)
    flags = ("--engines", urls, "--health-interval-s", "0.5")
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("proxy"), *flags) as process:
        yield process


def engine_table(proxy: ProxyProcess) -> dict[str, dict]:
    rows = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin, timeout=30).json()
    return {row["url"]: row for row in rows}


async def streamed(session: dict) -> dict:
    """One streamed chat answer as the client saw it: text, token strings, logprobs, usage."""
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    seen: dict = {"id": None, "text": "", "tokens": [], "logprobs": [], "finish": [], "usage": None}
    try:
        chunks = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me about numbers."}],
            max_tokens=MAX_TOKENS,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            seen["id"] = chunk.id
            if chunk.usage is not None:
                seen["usage"] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                seen["text"] += choice.delta.content or ""
                for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                    seen["tokens"].append(entry.token)
                    seen["logprobs"].append(entry.logprob)
                if choice.finish_reason:
                    seen["finish"].append(choice.finish_reason)
    finally:
        await client.close()
    return seen


def test_an_engine_killed_mid_stream_leaves_every_client_its_exact_stored_answer(
    proxy, engines, tiny_model_dir
):
    victim, survivor = engines
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sessions = [proxy.session(task_id=f"failover-{i}") for i in range(STREAMS)]

    async def run() -> list[dict]:
        streams = [asyncio.create_task(streamed(s)) for s in sessions]
        deadline = time.monotonic() + 60
        while engine_table(proxy)[victim.url]["in_flight"] == 0:
            assert time.monotonic() < deadline, "no request reached the first engine"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # some tokens streamed from it already
        victim.process.kill()
        return await asyncio.gather(*streams)

    answers = asyncio.run(run())
    moved = compared = 0
    for session, seen in zip(sessions, answers, strict=True):
        (turn,) = proxy.get_session(session["session_id"])["turns"]
        ids = turn["completion_ids"]
        assert seen["id"] == turn["completion_id"]
        assert seen["tokens"] == [tokenizer.decode([i]) for i in ids]
        assert len(seen["logprobs"]) == len(turn["logprobs"]) == len(ids) == seen["usage"]
        gaps = [abs(a - b) for a, b in zip(seen["logprobs"], turn["logprobs"], strict=True)]
        assert max(gaps) <= ECHO_TOLERANCE
        assert seen["text"] == turn["response"]["content"]
        assert seen["finish"] == [turn["finish_reason"]] and seen["finish"][0] in ("stop", "length")
        compared += len(ids)
        if turn["resubmits"]:
            moved += 1
            assert turn["engine"] == survivor.url
    assert moved >= 1, "no stream was on the killed engine"
    assert engine_table(proxy)[victim.url]["healthy"] is False
    print(f"\n{STREAMS} streams, {moved} moved to the survivor, {compared} tokens compared")


NO_ENGINE_REQUESTS = [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, False),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("/completions", {"prompt": "hi"}, False),
    ("/completions", {"prompt": "hi"}, True),
]


def test_with_no_engine_left_every_request_is_a_prompt_503(proxy, engines):
    session = proxy.session(task_id="no-engine")
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    survivors = [engine for engine in engines if engine.process.poll() is None]
    for engine in survivors:
        engine.process.kill()
        engine.process.wait(timeout=10)
    killed = time.monotonic()
    answers = []
    with httpx.Client(base_url=session["base_url"], headers=headers, timeout=60) as http:
        for path, body, stream in NO_ENGINE_REQUESTS:
            started = time.monotonic()
            request = {"model": "tiny", "max_tokens": 4, "stream": stream, **body}
            with http.stream("POST", path, json=request) as reply:
                reply.read()  # a 503 sends no SSE byte: the whole body is the error
            answers.append((path, stream, reply, time.monotonic() - started))
    since_kill = time.monotonic() - killed
    latencies = {f"{path} stream={stream}": round(took, 2) for path, stream, _, took in answers}
    print(f"\n503 latencies (s): {latencies}; all four within {since_kill:.2f} s of the kill")
    for path, stream, reply, took in answers:
        where = (path, stream, reply.text[:300])
        assert reply.status_code == 503, where
        assert reply.headers["content-type"].startswith("application/json"), where
        assert int(reply.headers.get("retry-after", "0")) >= 1, where
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["type"] == "service_unavailable" and error["message"], where
        assert took < NO_ENGINE_BOUND_S, latencies
    assert httpx.get(f"{proxy.url}/health", timeout=30).status_code == 503
