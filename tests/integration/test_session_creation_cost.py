"""Creating a session costs the same whatever the run's history: the same statements, and rows
read that do not grow with the sessions the run already has (issue 27: creation counted all of
the run's sessions, even with admission off).

On Postgres, with the real admission path (``server.rl.sessions.create_session``, as in
test_admission_replicas.py): every statement a creation sends is captured, and each SELECT is
run again under ``EXPLAIN (ANALYZE, FORMAT JSON)`` in a transaction rolled back, which says how
many rows its scans read (rows returned plus rows a filter removed, times loops). A run with 10
sessions before and one with 5,000 (trained and consumed, as a long run's are; statistics
analysed, as autovacuum keeps them) must send the same statements and read a number of rows
that does not depend on the 5,000.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import psycopg
import pytest
from sqlalchemy import event

from server.rl.admission import Admission
from server.rl.sessions import create_session
from server.settings import ServerSettings
from server.store import database, runs
from server.store.tables import Session

SMALL, LARGE = 10, 5_000
HOLDING = 3  # open sessions that hold places, in either run
CONFIGS = {
    "admission off": {},
    "admission on": {"batch_size": 8, "max_staleness": 1},
    "admission on, groups": {"batch_size": 8, "group_size": 4, "max_staleness": 1},
}
# What one creation may read, at most, whatever the run's history: the run's row and the few
# sessions that hold places (HOLDING, and the one being created).
ROWS_BOUND = 2 * (HOLDING + 1) + 1


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


async def seed(ctx: SimpleNamespace, run_id: str, history: int) -> None:
    """``history`` sessions trained and consumed, and HOLDING open ones."""

    def session(status: str, trained: int | None) -> Session:
        return Session(
            id=f"sess-{uuid.uuid4().hex}",
            run_id=run_id,
            task_id="t",
            api_key_hash=uuid.uuid4().hex,
            status=status,
            trained_version=trained,
        )

    async with ctx.sessionmaker() as db, db.begin():
        db.add_all([session("consumed", 1) for _ in range(history)])
        db.add_all([session("open", None) for _ in range(HOLDING)])


def scanned_rows(plan: dict) -> int:
    """Rows the plan's table scans read: returned plus removed by a filter, times loops (a
    bitmap index scan is counted by the heap scan above it)."""
    rows = 0
    kind = plan["Node Type"]
    if kind.endswith("Scan") and kind != "Bitmap Index Scan":
        read = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        read += plan.get("Rows Removed by Index Recheck", 0)
        rows += int(read * plan["Actual Loops"])
    return rows + sum(scanned_rows(child) for child in plan.get("Plans", []))


async def creation_cost(ctx: SimpleNamespace, url: str, run_id: str) -> tuple[list[str], int]:
    """The statements one creation sends, and the rows its SELECTs read."""
    sent: list[tuple[str, object]] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:
        sent.append((statement, parameters))

    sync = ctx.engine.sync_engine
    event.listen(sync, "before_cursor_execute", capture)
    try:
        await create_session(ctx, run_id, "t", None, {})
    finally:
        event.remove(sync, "before_cursor_execute", capture)
    rows = 0
    with psycopg.connect(url) as connection:
        for statement, parameters in sent:
            if not statement.lstrip().upper().startswith("SELECT"):
                continue
            found = connection.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters
            ).fetchone()
            plan = found[0] if isinstance(found[0], list) else json.loads(found[0])
            rows += scanned_rows(plan[0]["Plan"])
            connection.rollback()
    return [statement for statement, _ in sent], rows


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_creating_a_session_reads_the_same_whatever_the_history(postgres, name):
    url = postgres.new_database()
    database.upgrade(url)

    async def scenario() -> dict[int, tuple[list[str], int]]:
        ctx = replica(url)
        try:
            made = {}
            for history in (SMALL, LARGE):
                async with ctx.sessionmaker() as db, db.begin():
                    run, _ = await runs.create_run(db, f"history-{history}", "tiny", CONFIGS[name])
                await seed(ctx, run.id, history)
                made[history] = run.id
            with psycopg.connect(url, autocommit=True) as connection:
                connection.execute("ANALYZE sessions")
            return {history: await creation_cost(ctx, url, made[history]) for history in made}
        finally:
            await ctx.engine.dispose()

    costs = asyncio.run(scenario())
    (small_sql, small_rows), (large_sql, large_rows) = costs[SMALL], costs[LARGE]
    assert large_sql == small_sql
    assert large_rows == small_rows, (small_rows, large_rows, large_sql)
    assert large_rows <= ROWS_BOUND, (large_rows, large_sql)
