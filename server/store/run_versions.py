"""A run's published versions, each kept under its name (``<run>@<version>``): where its weights
are, its lineage (the version current before it; for a rollback, the version whose weights it
serves again), what retention evicted, and when it was promoted.

Retention (``Retention``, applied by ``retain`` each time a version is recorded) bounds how many
versions stay pinnable and the bytes they hold: past either bound the oldest are evicted (a pin
to one answers 410), never the current version, the promoted one or version 0 (the base). Their
rows stay, as the lineage's. This module deletes no file."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.store.tables import RunVersion, utcnow

# The reason a version whose files were found gone is marked evicted with.
FILES_GONE = "files_gone"


async def record(
    db: AsyncSession,
    run_id: str,
    version: int,
    path: str | None,
    lora: bool,
    parent: int | None,
    source: int | None = None,
    size_bytes: int | None = None,
) -> RunVersion:
    """The version's row, written (a version number published again, after a load that landed
    but was never recorded, replaces what was there)."""
    row = RunVersion(
        run_id=run_id,
        version=version,
        path=path,
        lora=lora,
        parent=parent,
        source=source,
        size_bytes=size_bytes,
        published_at=utcnow(),
    )
    return await db.merge(row)


async def get(db: AsyncSession, run_id: str, version: int) -> RunVersion | None:
    return await db.get(RunVersion, (run_id, version))


async def listed(db: AsyncSession, run_id: str) -> list[RunVersion]:
    """The run's versions, oldest first."""
    query = select(RunVersion).where(RunVersion.run_id == run_id).order_by(RunVersion.version)
    return list(await db.scalars(query))


async def republished(db: AsyncSession, run_id: str) -> list[tuple[int, int]]:
    """(source, version) for each version that serves an earlier one's weights again, in order:
    what the staleness rule needs (``trainer.staleness``)."""
    query = (
        select(RunVersion.source, RunVersion.version)
        .where(RunVersion.run_id == run_id, RunVersion.source.is_not(None))
        .order_by(RunVersion.version)
    )
    rows = (await db.execute(query)).all()
    return [(int(source or 0), int(version)) for source, version in rows]


async def evict(db: AsyncSession, run_id: str, versions: Iterable[int], reason: str) -> None:
    """Mark ``versions`` evicted (a pin to one is refused); their rows stay, as the lineage's."""
    chosen = list(versions)
    if not chosen:
        return
    await db.execute(
        update(RunVersion)
        .where(
            RunVersion.run_id == run_id,
            RunVersion.version.in_(chosen),
            RunVersion.evicted_at.is_(None),
        )
        .values(evicted_at=utcnow(), evicted_reason=reason)
    )


@dataclass(frozen=True)
class Retention:
    """How many versions of a run stay pinnable (``kept``), and how many bytes of weights they
    may hold together (``max_bytes``; 0: no bound). The settings ``--versions-kept`` and
    ``--versions-max-mb``."""

    kept: int
    max_bytes: int = 0


def evictions(
    versions: Sequence[tuple[int, int | None]],
    keep: set[int],
    retention: Retention,
) -> dict[int, str]:
    """Which of a run's pinnable ``versions`` ((version, size in bytes or None), oldest first)
    retention evicts, with why: the oldest first, until at most ``retention.kept`` remain and
    their sizes sum to at most ``retention.max_bytes``; never one in ``keep`` (the current and
    promoted versions, 0), so those alone may stay over a bound."""
    left = list(versions)
    evicted: dict[int, str] = {}

    def total() -> int:
        return sum(size or 0 for _, size in left)

    for over, reason in (
        (
            lambda: len(left) > retention.kept,
            f"versions_kept: a run keeps its newest {retention.kept} versions pinnable",
        ),
        (
            lambda: retention.max_bytes > 0 and total() > retention.max_bytes,
            f"versions_max_mb: a run's pinnable versions hold at most "
            f"{retention.max_bytes / 2**20:g} MB of files",
        ),
    ):
        for version, size in list(left):
            if not over():
                break
            if version not in keep:
                left.remove((version, size))
                evicted[version] = reason
    return evicted


async def retain(
    db: AsyncSession, run_id: str, keep: set[int], retention: Retention
) -> dict[int, str]:
    """Evict the run's versions past ``retention`` (``evictions``); what it evicted, and why."""
    query = (
        select(RunVersion.version, RunVersion.size_bytes)
        .where(RunVersion.run_id == run_id, RunVersion.evicted_at.is_(None))
        .order_by(RunVersion.version)
    )
    pinnable = [(int(version), size) for version, size in (await db.execute(query)).all()]
    chosen = evictions(pinnable, {0, *keep}, retention)
    for reason in set(chosen.values()):
        await evict(db, run_id, [v for v, why in chosen.items() if why == reason], reason)
    return chosen


async def mark_promoted(db: AsyncSession, run_id: str, version: int) -> None:
    """Record when ``version`` was promoted (version 0, the base, has no row: nothing to mark)."""
    await db.execute(
        update(RunVersion)
        .where(RunVersion.run_id == run_id, RunVersion.version == version)
        .values(promoted_at=utcnow())
    )
