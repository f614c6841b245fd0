"""Two server processes on one Postgres store admit into the same run: the places bound holds
across them (server/rl/sessions.py takes the run's row lock for each check-and-create).

Each "replica" is the admission path as a server process runs it, ``create_session``, with an
``Admission`` (its in-process lock and wait) and an engine of its own on the same database, so
only the database stands between them, as between two real processes. The admission code is the
real one; what the context object lends it is only those two resources and a base URL.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from server.errors import StalenessBound
from server.rl.admission import Admission
from server.rl.sessions import create_session
from server.settings import ServerSettings
from server.store import database, runs
from server.store import sessions as store

LIMIT_CONFIG = {"batch_size": 2, "max_staleness": 1, "admission_wait_s": 0}
PLACES = (1 + 1) * 2
CALLERS = 16  # per run, half through each replica
RUNS = 12  # fresh runs in a row: the race between two replicas is a matter of milliseconds


def replica(url: str) -> SimpleNamespace:
    engine = database.connect(url)
    return SimpleNamespace(
        admission=Admission(),
        sessionmaker=database.sessionmaker(engine),
        settings=SimpleNamespace(
            base_url="http://replica",
            max_metadata_bytes=ServerSettings.model_fields["max_metadata_bytes"].default,
        ),
        engine=engine,
    )


async def places_held(replica: SimpleNamespace, run_id: str) -> int:
    async with replica.sessionmaker() as db:
        return sum(count for _, _, count, _ in await store.held_places(db, run_id))


async def race(first: SimpleNamespace, second: SimpleNamespace) -> tuple[int, int]:
    """CALLERS sessions asked of both replicas at once for a fresh run: (admitted, held)."""
    async with first.sessionmaker() as db, db.begin():
        run, _ = await runs.create_run(db, "replicas", "tiny", LIMIT_CONFIG)
    calls = [create_session((first, second)[i % 2], run.id, None, None, {}) for i in range(CALLERS)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    unexpected = [r for r in results if isinstance(r, Exception)]
    unexpected = [r for r in unexpected if not isinstance(r, StalenessBound)]
    assert not unexpected, unexpected
    admitted = sum(not isinstance(r, Exception) for r in results)
    return admitted, await places_held(first, run.id)


@pytest.mark.timeout(180)
def test_two_replicas_never_admit_past_the_places(postgres):
    url = postgres.new_database()
    database.upgrade(url)

    async def scenario() -> list[tuple[int, int]]:
        first, second = replica(url), replica(url)
        try:
            return [await race(first, second) for _ in range(RUNS)]
        finally:
            await first.engine.dispose()
            await second.engine.dispose()

    outcomes = asyncio.run(scenario())
    assert all(admitted == held == PLACES for admitted, held in outcomes), outcomes
