"""Rewards for a whole session or for one of its turns: idempotent, conflicts refused.

An ended session becomes trainable with its session reward; per-turn rewards alone make it
trainable only when the run says they suffice (``turn_rewards_suffice``). The session's
``rewarded`` flag means exactly that: it has what it needs to become trainable. An eval session
becomes ``evaluated`` instead, and keeps taking rewards there as a trainable one does; a
production session, ``served`` once ended, keeps taking them too.
"""

from __future__ import annotations

from sqlalchemy import case, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from server.errors import CompletionNotFound, RewardConflict, RewardsClosed
from server.store import sessions
from server.store.tables import SESSION_TARGET, Reward, Session, Turn, utcnow

TAKES_REWARDS = (
    sessions.OPEN,
    sessions.ENDED,
    sessions.TRAINABLE,
    sessions.EVALUATED,
    sessions.SERVED,
)


async def add_reward(
    db: AsyncSession,
    session: Session,
    value: float,
    completion_id: str | None = None,
    turn_rewards_suffice: bool = False,
) -> tuple[Reward, bool]:
    """Record a reward; returns it and whether it is new. Reposting the same value is a no-op."""
    if session.status in (sessions.CLAIMED, sessions.CONSUMED, sessions.DROPPED):
        raise RewardsClosed(session.status)
    if completion_id is not None:
        turn = await db.scalar(
            select(Turn.id).where(
                Turn.session_id == session.id, Turn.completion_id == completion_id
            )
        )
        if turn is None:
            raise CompletionNotFound(completion_id)
    target = completion_id or SESSION_TARGET
    existing = await _existing(db, session.id, target)
    if existing is None:
        reward = Reward(
            session_id=session.id, target=target, completion_id=completion_id, value=value
        )
        try:
            async with db.begin_nested():
                db.add(reward)
        except IntegrityError:  # the same target, posted concurrently
            existing = await _existing(db, session.id, target)
        else:
            await _mark_rewarded(db, session, completion_id is None or turn_rewards_suffice)
            return reward, True
    assert existing is not None
    if existing.value != value:
        raise RewardConflict(existing.value)
    return existing, False


async def _existing(db: AsyncSession, session_id: str, target: str) -> Reward | None:
    query = select(Reward).where(Reward.session_id == session_id, Reward.target == target)
    return (await db.scalars(query)).first()


async def _mark_rewarded(db: AsyncSession, session: Session, sufficient: bool) -> None:
    """A sufficient reward makes the session rewarded (an ended one trainable, or evaluated);
    either way the session must still take rewards (a claim may have taken it meanwhile)."""
    ended = Session.status == sessions.ENDED
    values: dict = {"rewarded": Session.rewarded}  # an insufficient reward changes nothing
    if sufficient:
        values = {
            "rewarded": True,
            "trainable_at": case((ended & ~Session.eval, utcnow()), else_=Session.trainable_at),
            "status": case((ended, sessions.rewarded_status_sql()), else_=Session.status),
        }
    result = await db.execute(
        update(Session)
        .where(Session.id == session.id, Session.status.in_(TAKES_REWARDS))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        await db.refresh(session)
        raise RewardsClosed(session.status)
    await db.refresh(session)


async def rewards_of(db: AsyncSession, session_ids: list[str]) -> dict[str, dict[str, float]]:
    """{session_id: {target: value}} for the given sessions."""
    rows = await db.execute(
        select(Reward.session_id, Reward.target, Reward.value).where(
            Reward.session_id.in_(session_ids)
        )
    )
    out: dict[str, dict[str, float]] = {sid: {} for sid in session_ids}
    for session_id, target, value in rows.all():
        out[session_id][target] = value
    return out
