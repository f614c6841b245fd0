"""A run's published versions, each kept under its name (``<run>@<version>``): where its weights
are, its lineage (the version current before it; for a rollback, the version whose weights it
serves again), what retention evicted, and when it was promoted."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.store.tables import RunVersion, utcnow


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
