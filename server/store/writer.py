"""Batched turn writes: many requests, one transaction, committed before anyone is answered.

Each request hands its turns to the writer and awaits their commit before it answers, so a
turn the client has seen is always stored; concurrent requests share one transaction, so the
store keeps up with serving. The rows go through :class:`TurnInserter` (SQLAlchemy's compiled
SQL on the driver's cursor).

Where the batch is written depends on the store:

- SQLite: on the event loop, on a connection of its own that never waits for a lock. A local
  commit in WAL mode does not sync to disk and takes ~0.1-0.3 ms; handing it to a thread
  and back cost more than the write (~0.25 ms and a GIL hand-over each way, measured in
  a running server). When another connection holds the write lock (a reward, a claim), the
  batch goes to a thread that waits for it. This connection does not checkpoint the WAL
  itself (a checkpoint copies pages and syncs: milliseconds that would stall every request);
  a thread does, each time ~4 MB (SQLite's default of 1000 pages) have been written.
- Other databases (Postgres): on a worker thread, one hand-off per batch; the network round
  trips must not block the loop.

A batch the store refuses fails every request in it, before any is answered: a fault (a disk
full, a store locked past its busy timeout or read-only, a lost Postgres: ``database.store_fault``)
as ``StoreUnavailable`` (503, Retry-After), which ``health`` logs once per episode; the next batch
that commits ends the episode. Anything else is a bug, logged with its traceback.

Write volume is kept in ``stats``; ``on_commit`` (the server's metrics) sees each batch's
latency.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

from server.errors import StoreUnavailable
from server.store.database import StoreHealth, store_fault
from server.store.turns import TurnInserter, TurnRecord

log = logging.getLogger(__name__)

CHECKPOINT_BYTES = 4 * 1024 * 1024  # SQLite checkpoints after 1000 pages of 4 KiB by default
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6


@dataclass
class WriterStats:
    batches: int = 0
    turns: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # time spent in transactions
    on_loop: int = 0  # SQLite batches written on the event loop
    deferred: int = 0  # ...and those that found the store locked and went to a thread
    checkpoints: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _locked(exc: BaseException) -> bool:
    """SQLite said busy or locked: another connection holds the write lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.OperationalError)
        and code is not None
        and (code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED))
    )


class TurnWriter:
    def __init__(
        self,
        engine: Engine,
        max_batch: int = 256,
        on_commit: Callable[[float], None] | None = None,
        checkpoint_bytes: int = CHECKPOINT_BYTES,
        health: StoreHealth | None = None,
    ) -> None:
        self._engine = engine
        self.health = health or StoreHealth()
        self._insert = TurnInserter(engine.dialect)
        self._on_commit = on_commit  # called with each committed batch's seconds
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[list[TurnRecord], asyncio.Future]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._local: Any = None  # SQLite: the connection written on the event loop
        self._checkpoint_bytes = checkpoint_bytes
        self._unchecked = 0  # bytes written on the loop since the last checkpoint began
        self._checkpoint: asyncio.Task | None = None
        self.stats = WriterStats()
        self.last_batch_seconds = 0.0

    def start(self) -> None:
        if self._engine.dialect.name == "sqlite":
            self._local = self._engine.raw_connection()
            self._local.detach()  # its settings differ from the pool's: never hand it back
            cursor = self._local.cursor()
            cursor.execute("PRAGMA busy_timeout=0")
            cursor.execute("PRAGMA wal_autocheckpoint=0")
            cursor.close()
        self._task = asyncio.create_task(self._run(), name="proxrl-turn-writer")

    async def stop(self) -> None:
        """Write what is queued, then stop."""
        await self._queue.join()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._checkpoint is not None:
            await asyncio.gather(self._checkpoint, return_exceptions=True)
        if self._local is not None:
            self._local.close()
            self._local = None

    async def write(self, records: list[TurnRecord]) -> None:
        """Store ``records``; returns once they are committed (raises if they could not be)."""
        if not records:
            return
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((records, done))
        await done

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit(batch)
            for _ in batch:
                self._queue.task_done()

    async def _commit(self, batch: list[tuple[list[TurnRecord], asyncio.Future]]) -> None:
        records = [record for records, _ in batch for record in records]
        started = time.perf_counter()
        try:
            if not self._write_here(records):
                await asyncio.to_thread(self._write, records)
        except Exception as exc:
            reason = self._fault(exc, len(records))
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc if reason is None else StoreUnavailable(reason))
            return
        self.health.recovered()
        elapsed = time.perf_counter() - started
        self.last_batch_seconds = elapsed
        self.stats.batches += 1
        self.stats.turns += len(records)
        prompt_tokens = sum(len(r.prompt_ids) for r in records)
        completion_tokens = sum(len(r.completion_ids) for r in records)
        self.stats.prompt_tokens += prompt_tokens
        self.stats.completion_tokens += completion_tokens
        self.stats.tokens += prompt_tokens + completion_tokens
        self.stats.seconds += elapsed
        if self._on_commit is not None:
            self._on_commit(elapsed)
        for _, done in batch:
            if not done.done():
                done.set_result(None)

    def _fault(self, exc: Exception, turns: int) -> str | None:
        """The store fault that failed a batch (told to ``health``), or None: a bug, logged."""
        reason = store_fault(exc)
        if reason is None:
            log.error("writing %d turns failed", turns, exc_info=exc)
        else:
            self.health.failed(reason)
        return reason

    def _write_here(self, records: list[TurnRecord]) -> bool:
        """SQLite: write on the loop unless the store is locked (then False: use a thread)."""
        if self._local is None:
            return False
        try:
            written = self._insert(self._local, records)
        except Exception as exc:
            if not _locked(exc):
                raise
            self.stats.deferred += 1
            return False
        self.stats.on_loop += 1
        self._unchecked += written
        if self._unchecked >= self._checkpoint_bytes and self._checkpoint is None:
            self._unchecked = 0
            self._checkpoint = asyncio.create_task(self._run_checkpoint())
        return True

    def _write(self, records: list[TurnRecord]) -> None:
        connection = self._engine.raw_connection()
        try:
            self._insert(connection, records)
        finally:
            connection.close()  # back to the pool

    async def _run_checkpoint(self) -> None:
        try:
            await asyncio.to_thread(self._checkpoint_wal)
            self.stats.checkpoints += 1
        except Exception as exc:
            if store_fault(exc) is None:  # a fault is the episode's, logged once
                log.exception("checkpointing the store's WAL failed (tried again ~4 MB later)")
        finally:
            self._checkpoint = None

    def _checkpoint_wal(self) -> None:
        """Copy the WAL into the database as far as readers allow (never blocks writers)."""
        with self._engine.connect() as connection:
            connection.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))
