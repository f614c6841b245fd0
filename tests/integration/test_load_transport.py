"""No request lost to the transport: 500 sessions x 3 turns through one shared httpx pool.

The client is what many agents run: one ``httpx.AsyncClient`` with its default limits and
keep-alive expiry (5 s), and no retries, so every transport error is counted, not hidden.
Sessions go in waves; between rounds the whole client idles for about 5 s, so pooled
connections are reused at ages around the client's expiry: a server that closed idle
connections at 5 s (uvicorn's default) would race the client there and lose requests.
Against ``proxrl serve`` on SQLite and on PostgreSQL: no transport error, no 5xx, every turn
stored; p50/p99 latencies printed.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SESSIONS = 500
TURNS = 3
WAVES = 5  # of SESSIONS // WAVES sessions each
CONCURRENCY = 64
MAX_TOKENS = 4
STREAMED_EVERY = 4  # one session in four streams its answers
# The client idles this long after each round: pooled connections are then reused at ages
# from just under to just over httpx's 5 s expiry (the round's last answers end at once).
PAUSES_S = (4.9, 4.95, 4.98, 5.0, 5.05)


@dataclass
class Figures:
    requests: int = 0
    transport_errors: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # of the chat turns
    answers: dict[str, list[str]] = field(default_factory=dict)  # session id -> answer ids
    stored: dict[str, list[str]] = field(default_factory=dict)  # session id -> its turns' ids

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the turns' latencies."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    def summary(self) -> str:
        return (
            f"{self.requests} requests, {len(self.transport_errors)} transport errors, "
            f"{len(self.server_errors)} 5xx, {len(self.other_errors)} other errors; "
            f"{len(self.latencies)} turns answered, "
            f"latency p50 {self.percentile(0.5) * 1000:.0f} ms, "
            f"p99 {self.percentile(0.99) * 1000:.0f} ms, "
            f"mean {statistics.fmean(self.latencies or [0]) * 1000:.0f} ms"
        )


async def _call(
    client: httpx.AsyncClient, figures: Figures, method: str, url: str, turn: bool = False, **kw
):
    """One request, classified (a turn's latency kept); None when it failed."""
    figures.requests += 1
    started = time.perf_counter()
    try:
        reply = await client.request(method, url, **kw)
    except httpx.TransportError as exc:
        figures.transport_errors.append(f"{method} {url}: {type(exc).__name__}: {exc}")
        return None
    if turn:
        figures.latencies.append(time.perf_counter() - started)
    if reply.status_code >= 500:
        figures.server_errors.append(f"{reply.status_code} {reply.text[:200]}")
        return None
    if reply.status_code >= 300:
        figures.other_errors.append(f"{reply.status_code} {reply.text[:200]}")
        return None
    return reply


def _answer_of(reply: httpx.Response, streamed: bool) -> tuple[str, str]:
    """The answer's id and text, from a JSON body or an SSE body read whole."""
    if not streamed:
        body = reply.json()
        return body["id"], body["choices"][0]["message"]["content"] or ""
    text, answer_id = "", ""
    for block in reply.text.split("\n\n"):
        payload = block.removeprefix("data: ").strip()
        if not payload or payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        answer_id = chunk["id"]
        text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return answer_id, text


async def _turn(client, figures, gate, session: dict, messages: list, streamed: bool) -> None:
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "stream": streamed}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    async with gate:
        reply = await _call(
            client, figures, "POST", f"{session['base_url']}/chat/completions", turn=True,
            json=body, headers=headers,
        )  # fmt: skip
    if reply is None:
        return
    answer_id, text = _answer_of(reply, streamed)
    figures.answers.setdefault(session["session_id"], []).append(answer_id)
    messages.append({"role": "assistant", "content": text})


async def load(url: str, admin_key: str, seed: int = 0) -> Figures:
    """Create SESSIONS sessions over REST, then run their TURNS turns wave by wave."""
    rng = random.Random(seed)
    figures = Figures()
    gate = asyncio.Semaphore(CONCURRENCY)
    admin = {"Authorization": f"Bearer {admin_key}"}
    pauses = iter(PAUSES_S * 10)
    async with httpx.AsyncClient(timeout=120) as client:  # default limits and keep-alive

        async def create() -> dict | None:
            async with gate:
                reply = await _call(
                    client, figures, "POST", f"{url}/rl/sessions", headers=admin, json={}
                )
            return reply.json() if reply is not None else None

        created = await asyncio.gather(*(create() for _ in range(SESSIONS)))
        sessions = [s for s in created if s is not None]
        size = len(sessions) // WAVES
        for wave in range(WAVES):
            members = sessions[wave * size : (wave + 1) * size]
            histories: list[list[dict]] = [[] for _ in members]
            for turn in range(TURNS):
                await asyncio.sleep(next(pauses))
                for history in histories:
                    history.append({"role": "user", "content": f"Turn {turn}: {rng.random():.4f}"})
                await asyncio.gather(
                    *(
                        _turn(client, figures, gate, s, h, i % STREAMED_EVERY == 0)
                        for i, (s, h) in enumerate(zip(members, histories, strict=True))
                    )
                )

        async def stored(session: dict) -> tuple[str, list[str] | None]:
            async with gate:
                path = f"{url}/rl/sessions/{session['session_id']}"
                reply = await _call(client, figures, "GET", path, headers=admin)
            turns = reply.json()["turns"] if reply is not None else None
            return session["session_id"], [t["completion_id"] for t in turns or []]

        figures.stored = dict(await asyncio.gather(*(stored(s) for s in sessions)))
    return figures


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def proxy(request, tiny_model_dir, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"load-{request.param}")
    extra: list[str] = []
    if request.param == "postgres":
        extra += ["--db", request.getfixturevalue("postgres").new_database()]
    with ProxyProcess(tiny_model_dir, data_dir, *extra) as process:
        yield request.param, process


def test_no_request_is_lost_to_the_transport(proxy):
    backend, process = proxy
    started = time.monotonic()
    figures = asyncio.run(load(process.url, ProxyProcess.ADMIN_KEY))
    print(f"\n{backend}: {figures.summary()} in {time.monotonic() - started:.0f} s")
    assert figures.transport_errors == [], figures.transport_errors[:5]
    assert figures.server_errors == [], figures.server_errors[:5]
    assert figures.other_errors == [], figures.other_errors[:5]
    assert len(figures.answers) == SESSIONS
    assert sum(len(ids) for ids in figures.answers.values()) == SESSIONS * TURNS
    assert figures.stored == figures.answers
