"""Batched turn writes off the request path: many requests, one transaction.

Each request hands its turns to the writer and awaits their commit before it answers, so a
turn the client has seen is always stored; concurrent requests share one transaction, so the
store keeps up with serving. A batch is written on a worker thread through a synchronous
connection: one hand-off between threads per batch, where the asyncio drivers (aiosqlite)
hand off every statement and each hand-off can wait for the GIL. Write volume is kept in
``stats``; ``on_commit`` (the server's metrics) sees each batch's latency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from server.store.turns import TurnRecord, insert_turns

log = logging.getLogger(__name__)


@dataclass
class WriterStats:
    batches: int = 0
    turns: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # time spent in transactions

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class TurnWriter:
    def __init__(
        self,
        engine: Engine,
        max_batch: int = 256,
        on_commit: Callable[[float], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_commit = on_commit  # called with each committed batch's seconds
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[list[TurnRecord], asyncio.Future]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.stats = WriterStats()
        self.last_batch_seconds = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="proxrl-turn-writer")

    async def stop(self) -> None:
        """Write what is queued, then stop."""
        await self._queue.join()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

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
            await asyncio.to_thread(self._write, records)
        except Exception as exc:
            log.exception("writing %d turns failed", len(records))
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
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

    def _write(self, records: list[TurnRecord]) -> None:
        with self._engine.begin() as connection:
            insert_turns(connection, records)
