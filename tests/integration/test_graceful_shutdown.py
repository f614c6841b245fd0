"""SIGTERM drains: requests in flight (streamed or not) finish, every answered turn is stored,
the process exits 0 by itself, and a server started on the same data directory has them all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from tests.support import ProxyProcess

REQUESTS = 8  # half streamed, half not
MAX_TOKENS = 96


async def _plain(client: httpx.AsyncClient, session: dict) -> dict:
    reply = await client.post(
        f"{session['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json=_body(),
    )
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    (choice,) = answer["choices"]
    return {
        "id": answer["id"],
        "text": choice["message"]["content"],
        "finish": choice["finish_reason"],
    }


async def _streamed(client: httpx.AsyncClient, session: dict, started: asyncio.Event) -> dict:
    url = f"{session['base_url']}/chat/completions"
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    text, finish, done, answer_id = "", None, False, None
    async with client.stream("POST", url, headers=headers, json=_body(stream=True)) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            answer_id = chunk["id"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
            if text:
                started.set()
    assert done, "the stream ended without [DONE]"
    return {"id": answer_id, "text": text, "finish": finish}


def _body(stream: bool = False) -> dict:
    messages = [{"role": "user", "content": "Count slowly from one to a hundred."}]
    # Greedy: the tiny model runs to max_tokens on this prompt (no early end of text).
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {**body, "stream": stream}


def test_sigterm_drains_requests_in_flight_and_stores_every_turn(tiny_model_dir, tmp_path):
    data_dir = tmp_path / "data"
    proxy = ProxyProcess(tiny_model_dir, data_dir).wait_ready()
    try:
        sessions = [proxy.session() for _ in range(REQUESTS)]

        async def run() -> tuple[list[dict], bool]:
            async with httpx.AsyncClient(timeout=120) as client:
                first_tokens = [asyncio.Event() for _ in range(REQUESTS // 2)]
                tasks = [
                    asyncio.create_task(_streamed(client, session, first_tokens[i]))
                    for i, session in enumerate(sessions[: REQUESTS // 2])
                ] + [asyncio.create_task(_plain(client, s)) for s in sessions[REQUESTS // 2 :]]
                # Every stream has sent tokens: every request is being sampled.
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 60)
                in_flight = not any(task.done() for task in tasks)
                os.kill(proxy.process.pid, signal.SIGTERM)
                return list(await asyncio.gather(*tasks)), in_flight

        answers, in_flight = asyncio.run(run())
        assert in_flight, "a request ended before SIGTERM: the test proves nothing"
        for answer in answers:
            assert answer["finish"] == "length", answer
        stopped = time.monotonic()
        assert proxy.process.wait(timeout=60) == 0
        print(f"\nexited 0, {time.monotonic() - stopped:.2f}s after the last answer")
    finally:
        proxy.stop()

    with ProxyProcess(tiny_model_dir, data_dir) as again:
        for session, answer in zip(sessions, answers, strict=True):
            (turn,) = again.get_session(session["session_id"])["turns"]
            assert turn["completion_id"] == answer["id"]
            assert turn["response"]["content"] == answer["text"]
            assert turn["finish_reason"] == answer["finish"]
