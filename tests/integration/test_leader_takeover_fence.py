"""A replica taking the lead resumes the engines fenced by the store, as a swap's own resume is
(``server.startup.take_part`` through ``server.rl.weights.resume_after_swap``): if the lead moved
on while it took it, and the new leader paused the engines for a swap, it leaves them paused.

Found by a review: the takeover's resume was sent after a store read (``version_on_takeover``)
with nothing checked; a replica whose read was slow, and whose lock's connection was cut
meanwhile, resumed the engine under the new leader's swap and went on believing it led. Shown
on a real PostgreSQL database, two real ``Election``s and the stub engine (bench/stub_engine.py,
whose pause holds new requests until the continue, as SGLang's does), the slow read held open
on an event.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import psycopg

from server import startup
from server.engine_client.pool import EnginePool
from server.rl import weights
from server.store import database, leadership
from server.store.leadership import Election
from tests.support import stub_engine_in_loop

WAIT_S = 10.0


def test_a_takeover_whose_lead_moved_on_leaves_the_new_leaders_swap_paused(
    postgres, monkeypatch, caplog
):
    url = postgres.new_database()
    database.upgrade(url)
    read = asyncio.Event()  # the first replica's store read, held until the second swaps

    async def slow_read(_ctx) -> int:
        await read.wait()
        return 0

    monkeypatch.setattr(startup, "version_on_takeover", slow_read)

    async def scenario() -> tuple[bool, bool]:
        async with stub_engine_in_loop() as (stub, engine_url):
            return await takeover(stub, engine_url)

    async def takeover(stub, engine_url: str) -> tuple[bool, bool]:
        first_pool = EnginePool([engine_url], generate_timeout=5.0, health_interval=60.0)
        second_pool = EnginePool([engine_url], generate_timeout=5.0, health_interval=60.0)
        first = Election(url, "first", "http://first")
        second = Election(url, "second", "http://second")
        db = database.connect(url)
        try:
            settings = SimpleNamespace(leader_check_s=1.0, database_url=url)
            ctx = SimpleNamespace(
                pool=first_pool,
                replica_id="first",
                sessionmaker=database.sessionmaker(db),
                settings=settings,
            )
            first_pool.leading = False
            taking = asyncio.create_task(startup.take_part(ctx, first))  # type: ignore[arg-type]
            async with asyncio.timeout(WAIT_S):
                while not first.leading:
                    await asyncio.sleep(0.01)
            with psycopg.connect(url, autocommit=True) as cut:  # the first's lock's connection
                cut.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks "
                    "WHERE locktype = 'advisory' AND granted"
                )
            async with asyncio.timeout(WAIT_S):
                while not await second.check():
                    await asyncio.sleep(0.1)
            await second_pool.engines[0].client.pause("abort")  # the second's swap
            read.set()  # the first's read returns
            await taking
            async with asyncio.timeout(WAIT_S):
                while first_pool.background:  # its resume, fenced
                    await asyncio.sleep(0.01)
            return stub.resumed.is_set(), first_pool.leading
        finally:
            await first.close()
            await second.close()
            await first_pool.stop()
            await second_pool.stop()
            await db.dispose()

    caplog.set_level(logging.WARNING, logger="server.rl.weights")
    resumed, first_leads = asyncio.run(scenario())
    assert not resumed  # the code before: resumed under the second's swap
    assert not first_leads  # it follows the replica that leads
    # Fenced, not cut short: the store said who leads (a store fault would leave it paused too).
    assert "the engines stay paused: replica second leads now" in caplog.text


def test_a_resume_is_never_reported_sent_when_a_bound_cut_it(postgres, monkeypatch):
    """The store slow to say who leads (0.8 s) and the engine slow to answer the resume (0.3 s),
    with the bounds scaled down (0.5 s each): the fenced resume must never report an engine
    resumed that was not (the swap would put it back in rotation paused, for good). The code
    before bounded both by one timeout, which cut the resume after the store's answer and
    reported it sent (found by a review)."""
    url = postgres.new_database()
    database.upgrade(url)
    monkeypatch.setattr(weights, "STORE_WAIT_S", 0.5)
    monkeypatch.setattr(weights, "FENCED_CALL_S", 0.5)
    real_locked_leader = leadership.locked_leader

    async def slow_locked_leader(*args, **kwargs):
        await asyncio.sleep(0.8)
        return await real_locked_leader(*args, **kwargs)

    monkeypatch.setattr(leadership, "locked_leader", slow_locked_leader)

    async def scenario() -> tuple[list | None, bool, bool]:
        async with stub_engine_in_loop() as (stub, engine_url):
            pool = EnginePool([engine_url], generate_timeout=5.0, health_interval=60.0)
            election = Election(url, "only", "http://only")
            db = database.connect(url)
            try:
                assert await election.check()
                client = pool.engines[0].client
                await client.pause("abort")
                real_resume = client.resume

                async def slow_resume() -> None:
                    await asyncio.sleep(0.3)
                    await real_resume()

                client.resume = slow_resume  # type: ignore[method-assign]
                settings = SimpleNamespace(database_url=url)
                ctx = SimpleNamespace(
                    pool=pool, replica_id="only", sessionmaker=database.sessionmaker(db),
                    settings=settings,
                )  # fmt: skip
                answers = await weights._resume(ctx, pool.engines)  # type: ignore[arg-type]
                await asyncio.sleep(0.5)  # a cut call would have landed by now
                return answers, stub.resumed.is_set(), pool.leading
            finally:
                await election.close()
                await pool.stop()
                await db.dispose()

    answers, resumed, leading = asyncio.run(scenario())
    if answers is not None:  # reported sent: each engine resumed or its error given
        assert resumed or answers[0] is not None, answers  # the code before: [None], paused
    else:  # not sent: the replica follows until its next check, which resumes them
        assert not leading
