"""Which adapter serves a LoRA run's requests: its current version's, read from the store at most
every ``ttl_s`` seconds and kept in memory meanwhile (every request of every run needs it). A
replica that published it knows at once (``put``); another sharing the store within ``ttl_s``, and
meanwhile serves the version before, whose adapter the engines still hold
(``--adapters-kept``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import async_sessionmaker

from server.store.byte_lru import MB, ByteLRU

RUN_ADAPTER_TTL_S = 2.0


def adapter_name(run_id: str, version: int) -> str:
    """The name a version of a LoRA run's adapter has on every engine: never reused for other
    weights (engines load a name once; a new version is a new name)."""
    return f"{run_id}@{version}"


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA run's current version: the engines' name for its adapter, and where it lives."""

    run_id: str
    version: int
    path: str

    @property
    def name(self) -> str:
        return adapter_name(self.run_id, self.version)


class RunAdapters:
    def __init__(
        self, sessionmaker: async_sessionmaker, ttl_s: float = RUN_ADAPTER_TTL_S, budget_bytes=MB
    ) -> None:
        self.sessionmaker = sessionmaker
        self.ttl_s = ttl_s
        # run id -> (monotonic time, its adapter or None: a full-weight run, or version 0)
        self._read: ByteLRU[str, tuple[float, ServedAdapter | None]] = ByteLRU(
            budget_bytes, size_of=lambda entry: 300 + len(entry[1].path if entry[1] else "")
        )

    async def get(self, run_id: str) -> ServedAdapter | None:
        """The adapter that serves ``run_id`` now; None where the base model does (a full-weight
        run, a LoRA run before its first version, no such run)."""
        cached = self._read.get(run_id)
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            return cached[1]
        from server.store.runs import get_run

        read_at = time.monotonic()
        async with self.sessionmaker() as db:
            run = await get_run(db, run_id)
        served = None
        if run is not None and run.lora and run.policy_version > 0 and run.weights_path:
            served = ServedAdapter(run.id, run.policy_version, run.weights_path)
        newer = self._read.get(run_id)
        if newer is not None and newer[0] > read_at:  # a publish's put while this read ran
            return newer[1]
        self._read.put(run_id, (read_at, served))
        return served

    def put(self, adapter: ServedAdapter) -> None:
        self._read.put(adapter.run_id, (time.monotonic(), adapter))

    def put_base(self, run_id: str) -> None:
        """The run is served by the base model from now on (a LoRA run rolled back to 0)."""
        self._read.put(run_id, (time.monotonic(), None))
