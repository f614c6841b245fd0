"""Trainer steps: the figures a trainer reports after each step, one row per (run, step).

Reposting a step replaces its figures (a trainer resumed from a checkpoint trains the steps
after it again, and the new figures are the true ones). A step's time is when it was trained:
a step trained again (a resumed trainer's, at a new policy version) takes the new time, while a
repost at the same version (a clean stop's, which adds ``stopped_at``) keeps the old one, so
"last step ... ago" and the step interval stay true. Reads never load a whole run: the latest
steps, the steps after a given one, or every n-th step when a run has many.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from server.store.tables import TrainerStep, utcnow


async def record_step(
    db: AsyncSession, run_id: str, step: int, version: int, metrics: dict[str, Any]
) -> bool:
    """Insert or replace the figures of ``step``; True when the step is new. A replacement at
    the same ``version`` keeps the step's ``created_at``."""
    existed = await db.scalar(
        select(TrainerStep.id).where(TrainerStep.run_id == run_id, TrainerStep.step == step)
    )
    values = {
        "run_id": run_id,
        "step": step,
        "version": version,
        "metrics": metrics,
        "created_at": utcnow(),
    }
    insert = postgresql.insert if db.get_bind().dialect.name == "postgresql" else sqlite.insert
    statement = insert(TrainerStep).values(**values)
    new = statement.excluded
    trained_again = TrainerStep.version != new.version
    statement = statement.on_conflict_do_update(
        index_elements=["run_id", "step"],
        set_={
            "version": new.version,
            "metrics": new.metrics,
            "created_at": case((trained_again, new.created_at), else_=TrainerStep.created_at),
        },
    )
    await db.execute(statement)
    return existed is None


async def step_count(db: AsyncSession, run_id: str) -> int:
    query = select(func.count()).where(TrainerStep.run_id == run_id)
    return int(await db.scalar(query) or 0)


async def steps_after(
    db: AsyncSession, run_id: str, after_step: int, max_points: int
) -> list[TrainerStep]:
    """The run's steps after ``after_step`` in order; every n-th one when there are more than
    ``max_points`` (the last step always included)."""
    where = (TrainerStep.run_id == run_id, TrainerStep.step > after_step)
    count = int(await db.scalar(select(func.count()).where(*where)) or 0)
    query = select(TrainerStep).where(*where)
    if count > max_points:
        stride = -(-count // max_points)
        last = select(func.max(TrainerStep.step)).where(*where).scalar_subquery()
        query = query.where((TrainerStep.step % stride == 0) | (TrainerStep.step == last))
    return list(await db.scalars(query.order_by(TrainerStep.step)))


async def latest_steps(db: AsyncSession, run_ids: list[str]) -> dict[str, TrainerStep]:
    """Each run's last reported step (runs without one are missing)."""
    if not run_ids:
        return {}
    last = (
        select(TrainerStep.run_id, func.max(TrainerStep.step).label("step"))
        .where(TrainerStep.run_id.in_(run_ids))
        .group_by(TrainerStep.run_id)
        .subquery()
    )
    query = select(TrainerStep).join(
        last, (TrainerStep.run_id == last.c.run_id) & (TrainerStep.step == last.c.step)
    )
    return {step.run_id: step for step in await db.scalars(query)}
