"""Several engines behind one proxy: load balancing and session affinity.

Engines that die (one mid-stream, then the last) are drilled in
tests/reliability/test_engine_failover.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support import EngineProcess, ProxyProcess


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


def engine_table(proxy) -> dict[str, dict]:
    rows = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin).json()
    return {row["url"]: row for row in rows}


async def chat(session: dict, stream: bool, max_tokens: int = 40) -> str:
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "Tell me about numbers."}]
    try:
        if not stream:
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens
            )
            return reply.choices[0].message.content or ""
        text = ""
        chunks = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, stream=True
        )
        async for chunk in chunks:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        return text
    finally:
        await client.close()


def test_requests_spread_over_engines_and_sessions_stay(proxy, engines):
    sessions = [proxy.session() for _ in range(8)]

    async def run():
        await asyncio.gather(*(chat(s, stream=False) for s in sessions))

    asyncio.run(run())
    served = {url: row["served_tokens"] for url, row in engine_table(proxy).items()}
    assert all(tokens > 0 for tokens in served.values()), served
    # A session's turns stay on its engine while it is healthy and not much busier.
    session = sessions[0]
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    for _ in range(3):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
    turns = proxy.get_session(session["session_id"])["turns"]
    assert len({turn["engine"] for turn in turns}) == 1
