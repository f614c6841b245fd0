"""Connection flood drill: a real ``proxrl serve`` under an open-file limit of 1024 (a common
default: a connection cap of 480), holding 500 idle connections (250 kept alive after a
request, 250 silent) while 100 clients flood one session's chat requests past the session
class's bound of 32 in flight, ignoring Retry-After, and 8 well-behaved agents (pooled httpx
clients that honour Retry-After) hold conversations and a probe polls ``/health``.

What must hold: no transport error for anyone (the agents, the flood, the probe) and no other
status than 200 or 503 ``overloaded`` with Retry-After; every agent's turns answered in the end;
``/health`` answered throughout, within 1 s. The figures are printed (the flood's own latencies
include its 100 clients' CPU time in this process: the fast-refusal bound is held in
tests/integration/test_connections_limits.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.integration.test_connections_limits import idle_connections, open_file_limit
from tests.support import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DESCRIPTORS = 1024
SESSION_BOUND = 32
FLOODERS = 100
AGENTS = 8
TURNS = 6
FLOOD_S = 20.0
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@dataclass
class Tally:
    answered: int = 0
    refused: list[float] = field(default_factory=list)  # seconds to each 503
    transport_errors: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def note(self, reply: httpx.Response, seconds: float) -> None:
        if reply.status_code == 200:
            self.answered += 1
            self.latencies.append(seconds)
        elif reply.status_code == 503 and reply.headers.get("retry-after") == "1":
            assert reply.json()["error"]["code"] == "overloaded", reply.text
            self.refused.append(seconds)
        else:
            self.other.append(f"{reply.status_code} {reply.text[:200]}")


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0.0


async def flood(url: str, key: str, tally: Tally, until: float) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        while time.monotonic() < until:
            started = time.perf_counter()
            try:
                reply = await client.post("/v1/chat/completions", json=BODY)
            except httpx.TransportError as exc:
                tally.transport_errors.append(repr(exc))
                continue
            tally.note(reply, time.perf_counter() - started)
            await asyncio.sleep(0.1)  # an attacker ignores Retry-After


async def agent(url: str, key: str, tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": "Hello"}]
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
        turn = 0
        while turn < TURNS:
            started = time.perf_counter()
            try:
                reply = await client.post(
                    "/v1/chat/completions", json={**BODY, "messages": messages}
                )
            except httpx.TransportError as exc:
                tally.transport_errors.append(repr(exc))
                return
            tally.note(reply, time.perf_counter() - started)
            if reply.status_code == 503:
                await asyncio.sleep(float(reply.headers["retry-after"]))
                continue
            assert reply.status_code == 200, reply.text
            answer = reply.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "More"},
            ]
            turn += 1


async def probe(url: str, tally: Tally, until: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while time.monotonic() < until:
            started = time.perf_counter()
            try:
                reply = await client.get("/health")
            except httpx.TransportError as exc:
                tally.transport_errors.append(repr(exc))
                continue
            tally.note(reply, time.perf_counter() - started)
            await asyncio.sleep(0.2)


def test_a_connection_flood_leaves_well_behaved_clients_served(tiny_model_dir, tmp_path):
    extra = ("--max-requests-session", str(SESSION_BOUND), "--header-timeout-s", "5")
    with open_file_limit(DESCRIPTORS):
        process = ProxyProcess(tiny_model_dir, tmp_path, *extra)
    with process as proxy:
        flood_key = proxy.session(task_id="flood")["api_key"]
        agent_keys = [proxy.session(task_id="agent")["api_key"] for _ in range(AGENTS)]
        for key in (flood_key, *agent_keys):  # each session's first turn, alone
            first = httpx.post(
                f"{proxy.url}/v1/chat/completions", json=BODY, timeout=60,
                headers={"Authorization": f"Bearer {key}"},
            )  # fmt: skip
            assert first.status_code == 200, first.text

        async def drill() -> tuple[Tally, Tally, Tally]:
            idle = await idle_connections(proxy.url, 500)  # 250 kept alive, 250 silent
            until = time.monotonic() + FLOOD_S
            flooded, agents, health = Tally(), Tally(), Tally()
            try:
                await asyncio.gather(
                    *(flood(proxy.url, flood_key, flooded, until) for _ in range(FLOODERS)),
                    *(agent(proxy.url, key, agents) for key in agent_keys),
                    probe(proxy.url, health, until),
                )
            finally:
                for writer in idle:
                    writer.close()
            return flooded, agents, health

        flooded, agents, health = asyncio.run(drill())
    print(
        f"\nflood: {flooded.answered} answered, {len(flooded.refused)} refused "
        f"(p99 {p99(flooded.refused) * 1000:.0f} ms), {len(flooded.transport_errors)} transport "
        f"errors; agents: {agents.answered} turns, {len(agents.refused)} refusals retried, "
        f"p99 {p99(agents.latencies) * 1000:.0f} ms, {len(agents.transport_errors)} transport "
        f"errors; /health: {health.answered} answered, p99 {p99(health.latencies) * 1000:.0f} ms"
    )
    for tally in (flooded, agents, health):
        assert not tally.transport_errors, tally.transport_errors[:5]
        assert not tally.other, tally.other[:5]
    assert flooded.refused
    assert agents.answered == AGENTS * TURNS
    assert health.answered >= FLOOD_S / 2 and p99(health.latencies) < 1.0
