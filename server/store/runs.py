"""Runs: create, find, configure, and count what they hold."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.store import run_versions
from server.store.keys import new_id, new_key
from server.store.tables import Run, Session, Turn


async def create_run(
    db: AsyncSession, name: str, model: str, config: dict[str, Any], is_default: bool = False
) -> tuple[Run, str]:
    """A new run and its API key (returned once; only its hash is stored)."""
    key, key_hash = new_key("proxrl-run")
    run = Run(
        id=new_id("run"),
        name=name,
        model=model,
        config=config,
        api_key_hash=key_hash,
        is_default=is_default,
    )
    db.add(run)
    await db.flush()
    return run, key


async def get_run(db: AsyncSession, run_id: str) -> Run | None:
    return await db.get(Run, run_id)


async def lock_run(db: AsyncSession, run_id: str) -> Run | None:
    """The run, its row locked until the transaction ends (Postgres: SELECT ... FOR UPDATE), so
    that server processes sharing the store decide its admissions one at a time. SQLite takes
    no row locks; a SQLite store has one server process."""
    query = select(Run).where(Run.id == run_id).with_for_update()
    return (await db.scalars(query.execution_options(populate_existing=True))).first()


async def runs_named(db: AsyncSession, name: str) -> list[Run]:
    """The runs called ``name`` (names need not be unique), oldest first."""
    query = select(Run).where(Run.name == name).order_by(Run.created_at)
    return list(await db.scalars(query))


async def default_run(db: AsyncSession) -> Run | None:
    return (await db.scalars(select(Run).where(Run.is_default))).first()


async def list_runs(db: AsyncSession, limit: int = 100, offset: int = 0) -> list[Run]:
    query = select(Run).order_by(Run.created_at.desc()).limit(limit).offset(offset)
    return list(await db.scalars(query))


async def run_count(db: AsyncSession) -> int:
    return int(await db.scalar(select(func.count()).select_from(Run)) or 0)


async def run_by_key_hash(db: AsyncSession, key_hash: str) -> Run | None:
    return (await db.scalars(select(Run).where(Run.api_key_hash == key_hash))).first()


async def set_config(db: AsyncSession, run_id: str, config: dict[str, Any]) -> None:
    await db.execute(update(Run).where(Run.id == run_id).values(config=config))


async def policy_versions(db: AsyncSession) -> list[tuple[str, int]]:
    """(run_id, the policy version it serves) for every run."""
    rows = await db.execute(select(Run.id, Run.policy_version))
    return [(run_id, int(version)) for run_id, version in rows.all()]


async def others_at_version(db: AsyncSession, version: int, run_id: str) -> list[Run]:
    """The runs other than ``run_id`` whose policy version is ``version``."""
    query = select(Run).where(Run.policy_version == version, Run.id != run_id)
    return list(await db.scalars(query))


async def set_policy_version(
    db: AsyncSession,
    run_id: str,
    version: int,
    weights_path: str | None,
    lora: bool = False,
    source: int | None = None,
    size_bytes: int | None = None,
    retention: run_versions.Retention | None = None,
) -> None:
    """The run's new version, from full weights or (``lora``) an adapter at ``weights_path``,
    recorded among its versions after the one current until now (``source``: the earlier
    version whose weights it serves again, for a rollback), then the versions past
    ``retention`` evicted (never this one or the promoted one). The run's row is locked first
    (Postgres), so a promotion committing meanwhile is read, not evicted."""
    query = select(Run.policy_version, Run.promoted_version).where(Run.id == run_id)
    parent, promoted = (await db.execute(query.with_for_update())).first() or (None, None)
    values = {"policy_version": version, "weights_path": weights_path, "lora": lora}
    await db.execute(update(Run).where(Run.id == run_id).values(**values))
    await run_versions.record(
        db, run_id, version, weights_path, lora, parent, source=source, size_bytes=size_bytes
    )
    if retention is not None:
        keep = {version} if promoted is None else {version, promoted}
        await run_versions.retain(db, run_id, keep, retention)


async def published_runs(db: AsyncSession, lora: bool) -> list[Run]:
    """The runs that have published a version above 0, of adapters (``lora``) or full weights:
    the engines serve one base model, so the two kinds cannot share them."""
    query = select(Run).where(Run.policy_version > 0, Run.lora == lora).order_by(Run.created_at)
    return list(await db.scalars(query))


async def session_counts(db: AsyncSession, run_id: str) -> dict[str, int]:
    """Sessions of the run by status."""
    query = (
        select(Session.status, func.count())
        .where(Session.run_id == run_id)
        .group_by(Session.status)
    )
    return {status: count for status, count in (await db.execute(query)).all()}


async def run_totals(db: AsyncSession, run_id: str) -> dict[str, int]:
    """Turns, tokens, training rows, conversations and breaks recorded in the run."""
    turns = await db.execute(
        select(
            func.count(Turn.id),
            func.coalesce(func.sum(Turn.prompt_tokens), 0),
            func.coalesce(func.sum(Turn.completion_tokens), 0),
        ).where(Turn.run_id == run_id)
    )
    count, prompt_tokens, completion_tokens = turns.one()
    sessions = await db.execute(
        select(
            func.coalesce(func.sum(Session.row_count), 0),
            func.coalesce(func.sum(Session.conversations), 0),
            func.coalesce(func.sum(Session.breaks), 0),
        ).where(Session.run_id == run_id)
    )
    rows, conversations, breaks = sessions.one()
    return {
        "turns": int(count),
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": int(completion_tokens),
        "rows": int(rows or 0),
        "conversations": int(conversations or 0),
        "breaks": int(breaks or 0),
    }
