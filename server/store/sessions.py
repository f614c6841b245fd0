"""Sessions: their lifecycle (open -> ended -> trainable -> claimed -> consumed | dropped).

A session is trainable once it is ended and rewarded (``server.store.rewards`` says which rewards
suffice). Deadlines (``expire``) end idle sessions and resolve sessions whose reward never came,
as the run's config says; a dropped session says why in ``drop_reason``.

An evaluation session (``eval``) is served and recorded like any other but never trained: where
a training session would become trainable it becomes ``evaluated``, a final status that no claim,
group, deadline or admission count looks at. At the reward deadline an eval session with turn
rewards is evaluated (whatever ``turn_rewards_suffice`` says: they are its score); one with no
reward at all is dropped ("no_reward"), never given the run's default reward, which would be a
made-up score.

A production session (``production``) is traffic the run serves but does not train on: its end
makes it ``served`` at once, rewarded or not (nothing waits for its reward), a final status that,
like ``evaluated``, no claim, group, deadline or admission count looks at; rewards posted to it
are recorded all the same.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.store import drop_reasons
from server.store.keys import new_id, new_key
from server.store.run_config import RunConfig
from server.store.tables import SESSION_TARGET, Reward, Run, Session, utcnow

log = logging.getLogger(__name__)

OPEN, ENDED, TRAINABLE, CLAIMED, CONSUMED, DROPPED, EVALUATED, SERVED = (
    "open",
    "ended",
    "trainable",
    "claimed",
    "consumed",
    "dropped",
    "evaluated",
    "served",
)
STATUSES = (OPEN, ENDED, TRAINABLE, CLAIMED, CONSUMED, DROPPED, EVALUATED, SERVED)
# The kinds of session a group_id may hold, one kind per group (``group_kinds``).
TRAINING, EVAL, PRODUCTION = "training", "eval", "production"


def kind_of(eval: bool, production: bool) -> str:
    return EVAL if eval else PRODUCTION if production else TRAINING


def rewarded_status(session: Session) -> str:
    """What an ended session with the rewards it needs becomes."""
    return EVALUATED if session.eval else SERVED if session.production else TRAINABLE


def rewarded_status_sql() -> Any:
    """:func:`rewarded_status` in SQL, for an UPDATE of the session's own row."""
    return case((Session.eval, EVALUATED), (Session.production, SERVED), else_=TRAINABLE)


async def create_session(
    db: AsyncSession,
    run_id: str,
    task_id: str | None,
    group_id: str | None,
    metadata: dict[str, Any],
    eval: bool = False,
    production: bool = False,
) -> tuple[Session, str]:
    key, key_hash = new_key("proxrl-sess")
    session = Session(
        id=new_id("sess"),
        run_id=run_id,
        task_id=task_id,
        group_id=group_id,
        meta=metadata,
        api_key_hash=key_hash,
        eval=eval,
        production=production,
    )
    db.add(session)
    await db.flush()
    return session, key


async def get_session(db: AsyncSession, session_id: str) -> Session | None:
    return await db.get(Session, session_id)


async def session_by_key_hash(db: AsyncSession, key_hash: str) -> Session | None:
    return (await db.scalars(select(Session).where(Session.api_key_hash == key_hash))).first()


async def end_session(db: AsyncSession, session: Session, now: datetime | None = None) -> None:
    """End an open session (ending twice is a no-op); rewarded, it becomes trainable (an eval
    session: evaluated); a production session becomes served, rewarded or not."""
    if session.status != OPEN:
        return
    now = now or utcnow()
    await db.execute(
        update(Session)
        .where(Session.id == session.id, Session.status == OPEN)
        .values(
            ended_at=now,
            status=case(
                (Session.rewarded | Session.production, rewarded_status_sql()), else_=ENDED
            ),
            trainable_at=case(
                (Session.rewarded & ~Session.eval & ~Session.production, now), else_=None
            ),
        )
        .execution_options(synchronize_session=False)
    )
    await db.refresh(session)


# A training session holds an admission place in these statuses until a step trains it.
HOLDING = (OPEN, ENDED, TRAINABLE, CLAIMED)


async def held_places(
    db: AsyncSession, run_id: str
) -> list[tuple[str | None, str | None, int, datetime]]:
    """(group_id, task_id, sessions, the newest one's created_at) of the run's sessions that
    hold admission places: neither eval nor production, not yet trained by a step, neither
    consumed nor dropped (``server.rl.admission``)."""
    query = (
        select(Session.group_id, Session.task_id, func.count(), func.max(Session.created_at))
        .where(
            Session.run_id == run_id,
            Session.status.in_(HOLDING),
            Session.eval.is_(False),
            Session.production.is_(False),
            Session.trained_version.is_(None),
        )
        .group_by(Session.group_id, Session.task_id)
    )
    rows = await db.execute(query)
    return [(group, task, int(count), newest) for group, task, count, newest in rows]


async def group_kinds(db: AsyncSession, run_id: str, group_id: str) -> set[str]:
    """Which kinds (training, eval, production: ``kind_of``) the run's sessions of ``group_id``
    are."""
    query = select(Session.eval, Session.production).where(
        Session.run_id == run_id, Session.group_id == group_id
    )
    return {kind_of(bool(e), bool(p)) for e, p in (await db.execute(query.distinct())).all()}


async def expire(db: AsyncSession, now: datetime | None = None) -> dict[str, str]:
    """Apply every run's deadlines: idle open sessions end, unrewarded ended ones resolve.
    Returns the sessions that changed, with their new status."""
    now = now or utcnow()
    changed: dict[str, str] = {}
    for run in await db.scalars(select(Run)):
        config = RunConfig.model_validate(run.config)
        if config.idle_timeout_s is not None:
            idle = now - timedelta(seconds=config.idle_timeout_s)
            stale = await db.scalars(
                select(Session).where(
                    Session.run_id == run.id,
                    Session.status == OPEN,
                    Session.last_activity_at < idle,
                )
            )
            for session in stale:
                await end_session(db, session, now)
                changed[session.id] = session.status
        if config.reward_timeout_s is not None:
            deadline = now - timedelta(seconds=config.reward_timeout_s)
            late = await db.scalars(
                select(Session).where(
                    Session.run_id == run.id,
                    Session.status == ENDED,
                    Session.ended_at < deadline,
                )
            )
            for session in list(late):
                try:
                    async with db.begin_nested():
                        await _resolve_missing_reward(db, session, config, now)
                except Exception:  # one bad session must not stop the deadlines of the rest
                    log.exception("resolving the missing reward of %s failed", session.id)
                    continue
                changed[session.id] = session.status
    return changed


async def _resolve_missing_reward(
    db: AsyncSession, session: Session, config: RunConfig, now: datetime
) -> None:
    """No session reward by the deadline: per-turn rewards do if the run says they suffice (an
    eval session's always do), else on_missing_reward drops the session or gives it the default
    reward (an eval session is dropped: see the module doc)."""
    turn_rewards_suffice = config.turn_rewards_suffice or session.eval
    if session.rewarded or (turn_rewards_suffice and await _has_turn_reward(db, session.id)):
        session.rewarded = True
        session.status = rewarded_status(session)
        session.trainable_at = None if session.eval else now
        return
    if config.on_missing_reward == "drop" or session.eval:
        session.status = DROPPED
        session.drop_reason = drop_reasons.no_reward(config.reward_timeout_s or 0.0)
        return
    db.add(Reward(session_id=session.id, target=SESSION_TARGET, value=config.default_reward))
    session.rewarded = True
    session.status = TRAINABLE
    session.trainable_at = now


async def _has_turn_reward(db: AsyncSession, session_id: str) -> bool:
    query = select(Reward.id).where(
        Reward.session_id == session_id, Reward.target != SESSION_TARGET
    )
    return (await db.scalar(query.limit(1))) is not None


async def touch(db: AsyncSession, session_id: str, **values: Any) -> None:
    await db.execute(
        update(Session).where(Session.id == session_id).values(last_activity_at=utcnow(), **values)
    )


async def list_sessions(
    db: AsyncSession,
    run_id: str | None = None,
    status: str | None = None,
    task_id: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> list[Session]:
    query = select(Session)
    if run_id is not None:
        query = query.where(Session.run_id == run_id)
    if status is not None:
        query = query.where(Session.status == status)
    if task_id is not None:
        query = query.where(Session.task_id == task_id)
    query = query.order_by(Session.created_at.desc()).limit(limit).offset(offset)
    return list(await db.scalars(query))
