"""How often a multi-turn session breaks its training row when the agent sends back exactly
what it was served.

Starts a real ``proxrl serve`` on the tiny model (or ``--model``), runs ``--sessions`` chat
sessions of ``--turns`` turns each (every turn sends back the assistant messages it got, as
served: ``content``, and ``reasoning_content`` dropped as an OpenAI client drops it), then reads
each session's ``breaks`` from ``GET /rl/sessions/{id}``. A break here means the proxy could not
continue the row although the agent changed nothing: the number to drive to zero.

    .venv/bin/python -m bench.row_breaks --sessions 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from server.common.processes import ProxyProcess

ADMIN_KEY = "row-breaks-admin-key"
QUESTIONS = ["What is 2 + 3?", "And times four?", "Tell me why.", "Thanks, now minus one?"]


async def one_session(client: httpx.AsyncClient, turns: int, max_tokens: int) -> dict:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    session = (await client.post("/rl/sessions", json={}, headers=admin)).json()
    key = {"Authorization": f"Bearer {session['api_key']}"}
    messages: list[dict] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens}
        reply = await client.post("/v1/chat/completions", json=body, headers=key)
        reply.raise_for_status()
        message = reply.json()["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"] or ""})
    view = (await client.get(f"/rl/sessions/{session['session_id']}", headers=admin)).json()
    return {"breaks": view["breaks"], "rows": view["row_count"]}


async def run(url: str, sessions: int, turns: int, max_tokens: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)

    async def bounded(client: httpx.AsyncClient) -> dict:
        async with limit:
            return await one_session(client, turns, max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        results = await asyncio.gather(*(bounded(client) for _ in range(sessions)))
    broken = sum(1 for result in results if result["breaks"] > 0)
    return {
        "sessions": sessions,
        "turns": turns,
        "sessions_with_a_break": broken,
        "break_rate": broken / sessions,
        "breaks": sum(result["breaks"] for result in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: the tiny model)")
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="row-breaks-") as scratch:
        model = args.model
        if model is None:
            from server.common.tiny_model import create_tiny_model

            model = create_tiny_model(Path(scratch) / "tiny")
        started = time.monotonic()
        with ProxyProcess(model, Path(scratch) / "data", ADMIN_KEY) as proxy:
            proxy.wait_ready()
            result = asyncio.run(
                run(proxy.url, args.sessions, args.turns, args.max_tokens, args.concurrency)
            )
        result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
