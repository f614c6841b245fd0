"""The turn writer on real SQLite files and a real PostgreSQL database.

- :class:`TurnInserter` (compiled SQL on the driver's cursor) writes exactly the rows that
  SQLAlchemy Core's :func:`insert_turns` writes, byte for byte, on both backends.
- On SQLite the writer commits on the event loop; when another connection holds the write
  lock it neither fails nor blocks the loop: the batch waits on a thread and lands after.
- The loop's connection does not checkpoint the WAL itself; the writer's background
  checkpoints keep the WAL file from growing without bound.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert, text

from server.store import database, turns
from server.store.tables import Run, Session
from server.store.turns import TurnInserter, TurnRecord, insert_turns
from server.store.writer import TurnWriter

RUN_ID, SESSION_ID = "run-writer-test", "sess-writer-test"
FIXED_NOW = datetime(2026, 11, 23, 8, 30, 15, 123456, tzinfo=UTC)


def migrated_engine(url: str):
    database.upgrade(url)
    engine = database.connect_sync(url)
    with engine.begin() as connection:
        connection.execute(
            insert(Run).values(
                id=RUN_ID, name="r", model="tiny", config={}, api_key_hash="h-run",
                policy_version=0, is_default=False, created_at=FIXED_NOW,
            )
        )  # fmt: skip
        connection.execute(
            insert(Session).values(
                id=SESSION_ID, run_id=RUN_ID, meta={}, api_key_hash="h-sess", status="open",
                created_at=FIXED_NOW, last_activity_at=FIXED_NOW, rewarded=False,
                turn_count=0, row_count=0, breaks=0,
            )
        )  # fmt: skip
    return engine


def record(index: int, prompt_tokens: int = 40, text: str = "") -> TurnRecord:
    return TurnRecord(
        session_id=SESSION_ID,
        run_id=RUN_ID,
        completion_id=f"chatcmpl-{index}",
        request_id=f"chatcmpl-{index}",
        surface="chat" if index % 3 else "completions",
        model="gpt-4o-mini" if index % 2 else None,
        turn_index=index,
        row_index=index // 2,
        extends_previous=index % 2 == 1,
        conversation=index // 3,
        prompt_ids=list(range(prompt_tokens)),
        completion_ids=[7, 8, 9, 2],
        logprobs=[-0.25, -1.5, -0.125, -3.0],
        versions=[0, 0, 1, 1],
        finish_reason="stop",
        messages=[{"role": "user", "content": f"hi {index} é ✓ {text}"}] if index % 3 else None,
        tools=[{"type": "function", "function": {"name": "f"}}] if index % 2 else None,
        response={"role": "assistant", "content": "ok", "n": index},
        sampling={"temperature": 1.0, "max_tokens": 4, "stop": [], "seed": None, "n": 1},
        engine="http://127.0.0.1:30000" if index % 2 else None,
        resubmits=index % 3,
        new_row=index % 2 == 0,
        is_break=index == 4,
        new_conversation=index == 0,
    )


def stored(engine) -> tuple[list[tuple], list[tuple]]:
    """Every turn and session row as the driver returns it (no type processing)."""
    with engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT * FROM turns ORDER BY id").fetchall()
        sessions = connection.exec_driver_sql("SELECT * FROM sessions").fetchall()
    return [tuple(r) for r in rows], [tuple(s) for s in sessions]


@pytest.fixture(params=["sqlite", "postgres"])
def two_databases(request, tmp_path: Path):
    if request.param == "sqlite":
        urls = [database.default_url(tmp_path / "core"), database.default_url(tmp_path / "fast")]
    else:
        server = request.getfixturevalue("postgres")
        urls = [server.new_database(), server.new_database()]
    engines = [migrated_engine(url) for url in urls]
    yield engines
    for engine in engines:
        engine.dispose()


def test_inserter_writes_the_rows_core_writes(two_databases, monkeypatch) -> None:
    monkeypatch.setattr(turns, "utcnow", lambda: FIXED_NOW)  # the same clock for both writes
    core, fast = two_databases
    batches = [[record(0)], [record(1), record(2), record(3)], [record(4), record(5)]]
    inserter = TurnInserter(fast.dialect)
    for batch in batches:
        with core.begin() as connection:
            insert_turns(connection, batch)
        raw = fast.raw_connection()
        try:
            inserter(raw, batch)
        finally:
            raw.close()
    core_rows, core_sessions = stored(core)
    fast_rows, fast_sessions = stored(fast)
    assert len(core_rows) == 6
    assert fast_rows == core_rows
    assert fast_sessions == core_sessions
    turn_count = fast_sessions[0][list(Session.__table__.columns.keys()).index("turn_count")]
    assert turn_count == 6


def test_inserter_rolls_back_a_failed_batch(tmp_path: Path) -> None:
    engine = migrated_engine(database.default_url(tmp_path))
    inserter = TurnInserter(engine.dialect)
    raw = engine.raw_connection()
    try:
        inserter(raw, [record(0)])
        with pytest.raises(sqlite3.IntegrityError):  # the same completion id again
            inserter(raw, [record(1), record(0)])
        inserter(raw, [record(2)])
    finally:
        raw.close()
    rows, sessions = stored(engine)
    assert [row[3] for row in rows] == ["chatcmpl-0", "chatcmpl-2"]
    turn_count = sessions[0][list(Session.__table__.columns.keys()).index("turn_count")]
    assert turn_count == 2
    engine.dispose()


def test_sqlite_writer_waits_out_a_lock_without_blocking_the_loop(tmp_path: Path) -> None:
    url = database.default_url(tmp_path)
    engine = migrated_engine(url)

    async def scenario() -> None:
        writer = TurnWriter(engine)
        writer.start()
        try:
            await writer.write([record(0)])
            assert (writer.stats.on_loop, writer.stats.deferred) == (1, 0)

            holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
            pending = asyncio.create_task(writer.write([record(1)]))
            ticks = 0
            for _ in range(20):  # the loop keeps running while the batch waits
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 20 and not pending.done()
            assert writer.stats.deferred == 1
            holder.execute("COMMIT")
            holder.close()
            await asyncio.wait_for(pending, timeout=15)

            await writer.write([record(2)])  # and back on the loop
            assert (writer.stats.on_loop, writer.stats.deferred) == (2, 1)
        finally:
            await writer.stop()

    asyncio.run(scenario())
    rows, _ = stored(engine)
    assert [row[3] for row in rows] == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]
    engine.dispose()


def wal_bytes_after_writes(tmp_path: Path, checkpoint_bytes: int) -> tuple[int, int, int]:
    """Write ~3 MB of turns in 60 batches; the WAL file's size, checkpoints and turns stored."""
    url = database.default_url(tmp_path)
    engine = migrated_engine(url)
    filler = "x" * 50_000

    wal = Path(url.removeprefix("sqlite:///") + "-wal")

    async def scenario() -> tuple[int, int]:
        writer = TurnWriter(engine, checkpoint_bytes=checkpoint_bytes)
        writer.start()
        try:
            for index in range(60):
                await writer.write([record(index, text=filler)])
                for _ in range(200):  # let a running checkpoint finish, as an idle moment would
                    if writer._checkpoint is None:
                        break
                    await asyncio.sleep(0.005)
            # measured with the connections open: the last one to close removes the WAL
            return wal.stat().st_size, writer.stats.checkpoints
        finally:
            await writer.stop()

    size, checkpoints = asyncio.run(scenario())
    with engine.connect() as connection:
        count = connection.execute(text("SELECT count(*) FROM turns")).scalar_one()
    engine.dispose()
    return size, checkpoints, count


def test_sqlite_writer_checkpoints_the_wal_off_the_loop(tmp_path: Path) -> None:
    unchecked, none, stored_without = wal_bytes_after_writes(tmp_path / "never", 1 << 40)
    checked, some, stored_with = wal_bytes_after_writes(tmp_path / "often", 256 * 1024)
    assert stored_without == stored_with == 60
    assert none == 0 and some >= 5
    # The loop's connection never checkpoints: without the writer's checkpoints the WAL holds
    # every page written (~3 MB of text, at least); with them it is reused from the start.
    assert unchecked > 3_000_000
    assert checked < unchecked / 3
