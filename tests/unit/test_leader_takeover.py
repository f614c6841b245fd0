"""What a replica does with the engines when it takes the lead, and which version it expects.

- An engine that accepts connections and never answers (a hung GPU behind a live HTTP server)
  held the whole take-over: the resume of every engine was one wait, whose timeout escaped, so
  the replica held the lock but never led (every publish then answered 503 ``no_leader``) and
  a server starting that way did not start. Each engine's resume now has its own bound.
- A leader that lost the lead mid-swap and finished it records a newer version after another
  took over; the new leader expected its own (older) one and took every engine out of
  rotation. A leader now takes a newer version from the store (never an older one, and never
  during its own swap).
- A replica that took the lead while a swap of its own held the update lock left the engines to
  that swap; a swap refused before it paused them (a check of the run or of the lead) resumed
  nothing, so engines a dead leader left paused stayed paused until the next swap. The engines
  are now resumed once that swap is over.
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

from server import startup
from server.engine_client.pool import EnginePool
from tests.support import stub_engine_in_loop

SQLITE = "sqlite:///unused.db"  # one server: it always leads, and its resumes are not fenced


def test_a_hung_engine_does_not_keep_a_replica_from_leading(monkeypatch):
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # accepts, never answers
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"

    async def scenario() -> tuple[bool, int | None, float]:
        pool = EnginePool([url], generate_timeout=5.0, health_interval=60.0)
        pool.leading = False

        async def version(_ctx) -> int:
            return 3

        monkeypatch.setattr(startup, "store_version", version)
        election = SimpleNamespace(check=lambda: asyncio.sleep(0, result=True))
        ctx = SimpleNamespace(
            pool=pool, settings=SimpleNamespace(leader_check_s=0.2, database_url=SQLITE)
        )
        started = time.monotonic()
        try:
            await startup.take_part(ctx, election)  # type: ignore[arg-type]
        finally:
            await pool.stop()
        return pool.leading, pool.expected_version, time.monotonic() - started

    try:
        leading, expected, took = asyncio.run(scenario())
    finally:
        hung.close()
    assert leading and expected == 3
    assert took < 1.0, took  # the resume is the pool's background work, not the lead's wait


def test_a_leader_takes_a_newer_version_from_the_store_and_never_an_older_one():
    async def scenario() -> list[int | None]:
        pool = EnginePool([], health_interval=1.0)
        stored = {"version": 0}

        async def read() -> int:
            return stored["version"]

        pool.read_version = read
        pool.leading, pool.expected_version = True, 2
        seen = []
        for version in (1, 2, 5):  # older, the same, newer (recorded by a leader before it)
            stored["version"] = version
            await pool.follow()
            seen.append(pool.expected_version)
        stored["version"] = 7
        async with pool.update_lock:  # its own swap: it sets the version itself
            await pool.follow()
            seen.append(pool.expected_version)
        pool.leading = False  # a follower takes the store's, older or not
        stored["version"] = 4
        await pool.follow()
        seen.append(pool.expected_version)
        await pool.stop()
        return seen

    assert asyncio.run(scenario()) == [2, 2, 5, 5, 4]


def test_a_replica_forgets_its_last_swap_when_the_lead_changes(monkeypatch):
    """The retry shortcut checks a retried swap against the last swap this replica made *since
    it took the lead*: one from an earlier lead says nothing of what the engines hold after
    another leader's swaps (the code before kept it, so run A's retry of version 5 was answered
    200 while the engines held run B's version 5)."""

    async def version(_ctx) -> int:
        return 5

    monkeypatch.setattr(startup, "store_version", version)

    async def scenario() -> list[tuple[str, int] | None]:
        pool = EnginePool([], health_interval=60.0)
        ctx = SimpleNamespace(
            pool=pool, settings=SimpleNamespace(leader_check_s=0.2, database_url=SQLITE)
        )
        seen = []
        for leads in (False, True):  # loses the lead, then takes it again
            pool.last_swap = ("run-a", 5)
            election = SimpleNamespace(check=lambda leads=leads: asyncio.sleep(0, result=leads))
            await startup.take_part(ctx, election)  # type: ignore[arg-type]
            seen.append(pool.last_swap)
        await pool.stop()
        return seen

    assert asyncio.run(scenario()) == [None, None]


def test_a_replica_taking_the_lead_during_its_own_swap_leaves_the_engines_to_it(monkeypatch):
    """A replica that lost the lead mid-swap and takes it back while its swap still holds the
    engines paused does not resume them under the load (the swap resumes them when it ends):
    with the update lock held, no engine is asked until it is free (the resume waits for it in
    the pool's background), so a hung one costs the lead no wait."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # accepts, never answers: a resume would wait out its bound
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"

    async def version(_ctx) -> int:
        return 1

    monkeypatch.setattr(startup, "store_version", version)

    async def scenario() -> tuple[bool, float]:
        pool = EnginePool([url], generate_timeout=5.0, health_interval=60.0)
        pool.leading = False
        ctx = SimpleNamespace(
            pool=pool, settings=SimpleNamespace(leader_check_s=0.2, database_url=SQLITE)
        )
        election = SimpleNamespace(check=lambda: asyncio.sleep(0, result=True))
        started = time.monotonic()
        try:
            async with pool.update_lock:  # its swap
                await startup.take_part(ctx, election)  # type: ignore[arg-type]
        finally:
            await pool.stop()
        return pool.leading, time.monotonic() - started

    try:
        leading, took = asyncio.run(scenario())
    finally:
        hung.close()
    assert leading
    assert took < 1.0, took  # not a resume's wait


def test_stopping_ends_health_checks_that_swallow_their_cancellation():
    """A store read that turns its cancellation into an error (as the SQLite driver did once,
    "the connection was lost", when the server stopped mid-read): `follow` logs the error and
    the loop goes on, so one cancel never ended it and the server never finished stopping (a
    CI run's teardown waited 300 s). Now stop ends it within a few seconds."""

    async def scenario() -> float:
        pool = EnginePool([], health_interval=0.05)
        reading = asyncio.Event()

        async def read() -> int:
            reading.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                raise RuntimeError("the connection was lost") from None
            return 0

        pool.read_version = read
        pool.leading = False
        await pool.start()
        await asyncio.wait_for(reading.wait(), 5)
        started = time.monotonic()
        await asyncio.wait_for(pool.stop(), 10)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 5


def test_engines_a_dead_leader_paused_resume_after_a_swap_refused_before_its_pause(monkeypatch):
    """The stub engine (bench/stub_engine.py: SGLang's pause holds new requests until the
    continue), paused as a leader that died mid-swap leaves it. The replica taking the lead has a
    swap of its own under way, which is then refused before it pauses anything (it releases the
    update lock having resumed nothing): the engine is resumed once the lock is free. On the
    code before, it stayed paused."""

    async def version(_ctx) -> int:
        return 0

    monkeypatch.setattr(startup, "store_version", version)

    async def scenario() -> tuple[bool, bool]:
        async with stub_engine_in_loop() as (stub, url):
            pool = EnginePool([url], generate_timeout=5.0, health_interval=60.0)
            try:
                await pool.engines[0].client.pause("abort")  # the dead leader's swap
                pool.leading = False
                settings = SimpleNamespace(leader_check_s=0.2, database_url=SQLITE)
                ctx = SimpleNamespace(pool=pool, settings=settings)
                election = SimpleNamespace(check=lambda: asyncio.sleep(0, result=True))
                async with pool.update_lock:  # its own swap, refused before it paused them
                    await startup.take_part(ctx, election)  # type: ignore[arg-type]
                    held = not stub.resumed.is_set()
                for _ in range(200):
                    if stub.resumed.is_set():
                        break
                    await asyncio.sleep(0.01)
                return held, stub.resumed.is_set()
            finally:
                await pool.stop()

    held, resumed = asyncio.run(scenario())
    assert held  # not resumed under the swap
    assert resumed  # resumed once it was over
