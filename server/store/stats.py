"""Aggregated reads for the dashboard: counts, reward means, time buckets, session search.

Every read here is a GROUP BY or a page: none loads a table. Time buckets are computed in SQL
from each backend's own clock functions (SQLite stores datetimes as text, Postgres as
timestamptz), so a run's sessions are summarised without being fetched. Reward figures are the
training sessions' only: eval sessions' rewards are held-out scores (``server.store.evaluation``),
production sessions' are not the training's either.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Integer, and_, case, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql import ColumnElement

from server.store.rewards import SESSION_TARGET
from server.store.tables import Reward, Session, TrainerStep, Turn

UNIX_EPOCH_JULIAN_DAY = 2440587.5


def _dialect(db: AsyncSession) -> str:
    return db.get_bind().dialect.name


def epoch_seconds(column: Any, dialect: str) -> ColumnElement:
    """Unix seconds of a datetime column, in SQL."""
    if dialect == "sqlite":
        return (func.julianday(column) - UNIX_EPOCH_JULIAN_DAY) * 86400.0
    return cast(func.extract("epoch", column), Float)


def bucket_of(column: Any, width: int, dialect: str) -> ColumnElement:
    """The index of the ``width``-second bucket a datetime column falls in (floor)."""
    seconds = epoch_seconds(column, dialect)
    if dialect == "sqlite":
        return cast(seconds / width, Integer)  # truncation is floor for times after 1970
    return cast(func.floor(seconds / width), Integer)


# ----- runs ------------------------------------------------------------------------------------


async def session_counts(db: AsyncSession, run_ids: list[str]) -> dict[str, dict[str, int]]:
    """{run_id: {status: sessions}} for the given runs."""
    query = (
        select(Session.run_id, Session.status, func.count())
        .where(Session.run_id.in_(run_ids))
        .group_by(Session.run_id, Session.status)
    )
    out: dict[str, dict[str, int]] = {run_id: {} for run_id in run_ids}
    for run_id, status, count in (await db.execute(query)).all():
        out[run_id][status] = int(count)
    return out


async def reward_means(db: AsyncSession, run_ids: list[str]) -> dict[str, tuple[float, int]]:
    """{run_id: (mean session reward, rewarded sessions)} of the runs' training sessions."""
    query = (
        select(Session.run_id, func.avg(Reward.value), func.count())
        .join(Reward, Reward.session_id == Session.id)
        .where(
            Session.run_id.in_(run_ids),
            Reward.target == SESSION_TARGET,
            Session.eval.is_(False),
            Session.production.is_(False),
        )
        .group_by(Session.run_id)
    )
    return {r: (float(mean), int(n)) for r, mean, n in (await db.execute(query)).all()}


def reason_code(column: Any, dialect: str) -> ColumnElement:
    """The code of a ``drop_reason``, in SQL: its text before the first colon, trimmed (the
    whole text when it has no colon). The details after the colon differ from session to
    session, so only the code groups."""
    if dialect == "sqlite":
        colon = func.instr(column, ":")
        return func.trim(case((colon > 0, func.substr(column, 1, colon - 1)), else_=column))
    return func.trim(func.split_part(column, ":", 1))


async def dropped_by_reason(
    db: AsyncSession, run_ids: list[str], *, claimed: bool = False
) -> dict[str, dict[str, int]]:
    """{run_id: {reason code: dropped sessions}} (``reason_code``), grouped in SQL: the
    server's drops and the trainer's alike, or with ``claimed`` only the sessions dropped under
    a trainer's claim (they keep its id; the server's own drops carry none)."""
    conditions = [Session.run_id.in_(run_ids), Session.drop_reason.is_not(None)]
    if claimed:
        conditions.append(Session.claim_id.is_not(None))
    # The code is computed in a subquery and grouped by its column: grouping by the expression
    # itself would bind the colon twice, and Postgres takes two parameters for two expressions.
    coded = (
        select(
            Session.run_id.label("run_id"),
            reason_code(Session.drop_reason, _dialect(db)).label("code"),
        )
        .where(*conditions)
        .subquery()
    )
    query = select(coded.c.run_id, coded.c.code, func.count()).group_by(
        coded.c.run_id, coded.c.code
    )
    out: dict[str, dict[str, int]] = {run_id: {} for run_id in run_ids}
    for run_id, code, count in (await db.execute(query)).all():
        out[run_id][str(code)] = int(count)
    return out


@dataclass(frozen=True)
class StepSpan:
    count: int
    first_at: datetime
    last_at: datetime


async def step_spans(db: AsyncSession, run_ids: list[str]) -> dict[str, StepSpan]:
    """How many steps each run reported, and when the first and the last arrived."""
    query = (
        select(
            TrainerStep.run_id,
            func.count(),
            func.min(TrainerStep.created_at),
            func.max(TrainerStep.created_at),
        )
        .where(TrainerStep.run_id.in_(run_ids))
        .group_by(TrainerStep.run_id)
    )
    rows = (await db.execute(query)).all()
    return {run_id: StepSpan(int(n), first, last) for run_id, n, first, last in rows}


# ----- time buckets ----------------------------------------------------------------------------


async def session_time_span(db: AsyncSession, run_id: str) -> tuple[float, float] | None:
    """Unix seconds of the run's first and last session, or None without sessions."""
    seconds = epoch_seconds(Session.created_at, _dialect(db))
    query = select(func.min(seconds), func.max(seconds)).where(Session.run_id == run_id)
    first, last = (await db.execute(query)).one()
    return None if first is None else (float(first), float(last))


@dataclass(frozen=True)
class RewardBucket:
    bucket: int
    count: int
    mean: float
    mean_square: float
    low: float
    high: float


async def reward_buckets(db: AsyncSession, run_id: str, width: int) -> list[RewardBucket]:
    """Training sessions' rewards of the run by the ``width``-second bucket they arrived in."""
    bucket = bucket_of(Reward.created_at, width, _dialect(db)).label("bucket")
    query = (
        select(
            bucket,
            func.count(),
            func.avg(Reward.value),
            func.avg(Reward.value * Reward.value),
            func.min(Reward.value),
            func.max(Reward.value),
        )
        .join(Session, Session.id == Reward.session_id)
        .where(
            Session.run_id == run_id,
            Reward.target == SESSION_TARGET,
            Session.eval.is_(False),
            Session.production.is_(False),
        )
        .group_by(bucket)
        .order_by(bucket)
    )
    return [
        RewardBucket(int(b), int(n), float(mean), float(square), float(low), float(high))
        for b, n, mean, square, low, high in (await db.execute(query)).all()
    ]


async def session_buckets(db: AsyncSession, run_id: str, width: int) -> dict[int, dict[str, int]]:
    """Per ``width``-second bucket: sessions created (with their turns and multi-turn breaks)
    and sessions ended."""
    dialect = _dialect(db)
    created = bucket_of(Session.created_at, width, dialect).label("bucket")
    query = (
        select(created, func.count(), func.sum(Session.turn_count), func.sum(Session.breaks))
        .where(Session.run_id == run_id)
        .group_by(created)
    )
    out: dict[int, dict[str, int]] = {}
    for b, n, turns, breaks in (await db.execute(query)).all():
        out[int(b)] = {"created": int(n), "ended": 0, "turns": int(turns), "breaks": int(breaks)}
    ended = bucket_of(Session.ended_at, width, dialect).label("bucket")
    query = (
        select(ended, func.count())
        .where(Session.run_id == run_id, Session.ended_at.is_not(None))
        .group_by(ended)
    )
    for b, n in (await db.execute(query)).all():
        row = out.setdefault(int(b), {"created": 0, "ended": 0, "turns": 0, "breaks": 0})
        row["ended"] = int(n)
    return out


# ----- sessions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionFilter:
    run_id: str | None = None
    status: str | None = None
    task_id: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


def _session_reward():
    return Reward.__table__.alias("session_reward")


async def search_sessions(
    db: AsyncSession, where: SessionFilter, limit: int, offset: int
) -> tuple[int, list[tuple[Session, float | None]]]:
    """One page of sessions (newest first) matching ``where``, each with its session reward,
    and how many match in all."""
    reward = _session_reward()
    joined = and_(reward.c.session_id == Session.id, reward.c.target == SESSION_TARGET)
    conditions: list[ColumnElement] = []
    if where.run_id is not None:
        conditions.append(Session.run_id == where.run_id)
    if where.status is not None:
        conditions.append(Session.status == where.status)
    if where.task_id is not None:
        conditions.append(Session.task_id == where.task_id)
    if where.reward_min is not None:
        conditions.append(reward.c.value >= where.reward_min)
    if where.reward_max is not None:
        conditions.append(reward.c.value <= where.reward_max)
    if where.created_after is not None:
        conditions.append(Session.created_at >= where.created_after)
    if where.created_before is not None:
        conditions.append(Session.created_at < where.created_before)
    needs_reward = where.reward_min is not None or where.reward_max is not None
    counted = select(func.count()).select_from(Session)
    if needs_reward:
        counted = counted.join(reward, joined)
    total = int(await db.scalar(counted.where(*conditions)) or 0)
    page = (
        select(Session, reward.c.value)
        .outerjoin(reward, joined)
        .where(*conditions)
        .order_by(Session.created_at.desc(), Session.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return total, [(session, value) for session, value in (await db.execute(page)).all()]


async def completion_tokens(db: AsyncSession, session_ids: list[str]) -> dict[str, int]:
    """Completion tokens each session sampled."""
    query = (
        select(Turn.session_id, func.sum(Turn.completion_tokens))
        .where(Turn.session_id.in_(session_ids))
        .group_by(Turn.session_id)
    )
    return {sid: int(n) for sid, n in (await db.execute(query)).all()}


# ----- every run (/metrics) --------------------------------------------------------------------


async def sessions_by_run_and_status(db: AsyncSession) -> list[tuple[str, str, int]]:
    """(run_id, status, sessions) for every run and status that has sessions: one GROUP BY."""
    query = select(Session.run_id, Session.status, func.count()).group_by(
        Session.run_id, Session.status
    )
    return [(run_id, status, int(n)) for run_id, status, n in (await db.execute(query)).all()]
