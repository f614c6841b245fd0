"""Which adapter serves a LoRA run's requests: its current version's, read from the store at most
every ``ttl_s`` seconds and kept in memory meanwhile (every request of every run needs it). A
replica that published it knows at once (``put``); another sharing the store within ``ttl_s``, and
meanwhile serves the version before, whose adapter the engines still hold
(``--adapters-kept``). The version a run's promotion gate serves its production sessions is read
with it and only from the store: a publish keeps the time of that read (so a trainer publishing
faster than ``ttl_s`` cannot keep an old answer alive), and a promotion or a gate changed on this
replica drops the run's entry (``forget``); another replica sees it within ``ttl_s``.

A request may pin another version of its run (``version``): a LoRA run's published version that
retention kept and whose files are still there, or 0 (the base model); a full-weight run only
its current one (its engines hold no other weights). What cannot be served is an error of
``server.errors``: 404 never published, 410 evicted (or its files gone: then marked evicted, so
the next pin is refused without looking), 409 a full-weight run's other version. Answers are
kept ``ttl_s`` seconds as the current version's are."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import async_sessionmaker

from server.errors import ProxrlError, VersionEvicted, VersionNotFound, VersionNotServable
from server.store import run_versions
from server.store.byte_lru import MB, ByteLRU

RUN_ADAPTER_TTL_S = 2.0


def adapter_name(run_id: str, version: int) -> str:
    """The name a version of a LoRA run's adapter has on every engine: never reused for other
    weights (engines load a name once; a new version is a new name)."""
    return f"{run_id}@{version}"


@dataclass(frozen=True)
class ServedAdapter:
    """A version of a LoRA run: the engines' name for its adapter, and where it lives.
    ``pinned``: a version outside the run's kept window (a pin's, or the promoted one's), which
    engines hold only within their bound of pinned adapters."""

    run_id: str
    version: int
    path: str
    pinned: bool = False

    @property
    def name(self) -> str:
        return adapter_name(self.run_id, self.version)


@dataclass(frozen=True)
class RunServing:
    """What serves a run now: its current version (with its adapter, None where the base model
    serves), whether it is a LoRA run, and the version its promotion gate serves (None: no
    gate)."""

    version: int
    lora: bool
    adapter: ServedAdapter | None
    promoted: int | None = None


# A pinned version's answer: its adapter (None: the base model serves it), or why it cannot be.
Pinned = ServedAdapter | None | ProxrlError


class RunAdapters:
    def __init__(
        self, sessionmaker: async_sessionmaker, ttl_s: float = RUN_ADAPTER_TTL_S, budget_bytes=MB
    ) -> None:
        self.sessionmaker = sessionmaker
        self.ttl_s = ttl_s
        # run id -> (monotonic time of the store read, what serves it; None: no such run). A
        # publish's put may have made the version newer than that read; never the rest.
        self._read: ByteLRU[str, tuple[float, RunServing | None]] = ByteLRU(
            budget_bytes // 2, size_of=lambda entry: 300 + len(_path_of(entry[1]))
        )
        # (run id, version) -> (monotonic time, the pinned version's answer)
        self._pins: ByteLRU[tuple[str, int], tuple[float, Pinned]] = ByteLRU(
            budget_bytes // 2, size_of=lambda entry: 400 + len(str(entry[1]))
        )
        self._forgotten = 0  # how many times forget ran: a read under way then is not kept

    async def get(self, run_id: str) -> ServedAdapter | None:
        """The adapter that serves ``run_id`` now; None where the base model does (a full-weight
        run, a LoRA run before its first version, no such run)."""
        serving = await self.serving(run_id)
        return None if serving is None else serving.adapter

    async def serving(self, run_id: str) -> RunServing | None:
        """What serves ``run_id`` now (None: no such run)."""
        cached = self._read.get(run_id)
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            return cached[1]
        from server.store.runs import get_run

        read_at, forgotten = time.monotonic(), self._forgotten
        async with self.sessionmaker() as db:
            run = await get_run(db, run_id)
        serving = None
        if run is not None:
            adapter = None
            if run.lora and run.policy_version > 0 and run.weights_path:
                adapter = ServedAdapter(run.id, run.policy_version, run.weights_path)
            serving = RunServing(run.policy_version, run.lora, adapter, run.promoted_version)
        put = self._read.peek(run_id)
        newer = None if put is None else put[1]
        if serving is not None and newer is not None and newer.version > serving.version:
            # a publish's put while this read ran: its version, the rest as read
            serving = dataclasses.replace(
                serving, version=newer.version, lora=True, adapter=newer.adapter
            )
        if forgotten == self._forgotten:  # else what it read may be older than a promotion
            self._read.put(run_id, (read_at, serving))
        return serving

    def put(self, adapter: ServedAdapter) -> None:
        """A publish made ``adapter`` the run's current version. The rest of what serves the run
        (its promoted version) stays as the store last said, as old as it was: with nothing
        read yet, the next request reads the store (which has this version already)."""
        cached = self._read.peek(adapter.run_id)
        if cached is None or cached[1] is None:
            read_at, promoted = -math.inf, None
        else:
            read_at, promoted = cached[0], cached[1].promoted
        serving = RunServing(adapter.version, True, adapter, promoted)
        self._read.put(adapter.run_id, (read_at, serving))

    def forget(self, run_id: str) -> None:
        """A promotion, or a gate configured or removed, committed: the run's next request reads
        what serves it from the store."""
        self._forgotten += 1
        self._read.pop(run_id)

    def put_base(self, run_id: str) -> None:
        """A publish recorded that the base model serves the LoRA run again (a rollback to 0):
        the next request reads it from the store."""
        self._read.pop(run_id)

    async def version(self, run_id: str, version: int, param: str) -> ServedAdapter | None:
        """The adapter that serves the run's ``version`` (None: the base model, or the run's
        current full weights), or the error that says why it cannot be served (``param``: the
        request's field that pinned it)."""
        serving = await self.serving(run_id)
        if serving is not None and version == serving.version:
            return serving.adapter
        cached = self._pins.get((run_id, version))
        if cached is None or time.monotonic() - cached[0] >= self.ttl_s:
            cached = (time.monotonic(), await self._pinned(run_id, version, serving, param))
            self._pins.put((run_id, version), cached)
        if isinstance(cached[1], ProxrlError):
            raise cached[1]
        return cached[1]

    async def _pinned(
        self, run_id: str, version: int, serving: RunServing | None, param: str
    ) -> Pinned:
        current = 0 if serving is None else serving.version
        if serving is None or version > current:
            return VersionNotFound(run_id, version, param)
        if serving.lora and version == 0:
            return None  # the base model
        async with self.sessionmaker() as db:
            row = await run_versions.get(db, run_id, version)
        if row is None and version > 0:
            return VersionNotFound(run_id, version, param)
        if not serving.lora:
            return VersionNotServable(run_id, version, current, param)
        assert row is not None
        if row.evicted_at is not None:
            return VersionEvicted(
                f"Version {version} of run {run_id!r} was evicted ({row.evicted_reason}).", param
            )
        if row.path is None:
            return None  # a version that serves the base model again (a rollback to 0)
        if await asyncio.to_thread(_files_gone, row.path):
            async with self.sessionmaker() as db, db.begin():
                await run_versions.evict(db, run_id, [version], run_versions.FILES_GONE)
            return VersionEvicted(
                f"Version {version} of run {run_id!r} cannot be served: its files at "
                f"{row.path!r} are gone (evicted: {run_versions.FILES_GONE}).",
                param,
            )
        return ServedAdapter(run_id, version, row.path)


def _path_of(serving: RunServing | None) -> str:
    return serving.adapter.path if serving is not None and serving.adapter else ""


def _files_gone(path: str) -> bool:
    """Whether the adapter directory ``path`` is gone from a directory this machine has (the
    trainer's ``publish.keep_versions`` pruned it). A path whose parent this machine does not
    have is not judged: the engines may be on machines that have it."""
    directory = Path(path)
    return directory.parent.is_dir() and not directory.is_dir()
