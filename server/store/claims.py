"""The trainer's reader: claim trainable sessions exactly once, then confirm or release them.

A claim marks sessions ``claimed`` with a lease; confirming marks them ``consumed``; a lease that
runs out returns them to the pool for the next claim. Two trainers never get the same session
(SQLite serialises writers; on Postgres the candidates are locked with SKIP LOCKED). With a
``group_size`` only whole GRPO groups are claimed. Claimed sessions come back as training rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.store import sessions as status
from server.store.keys import new_id
from server.store.rewards import SESSION_TARGET, rewards_of
from server.store.rows import Row, assemble_rows
from server.store.tables import Session, Turn, utcnow
from server.store.turns import tokens_of


@dataclass
class ClaimedSession:
    session_id: str
    task_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    reward: float | None  # the session's reward (turn rewards are on the rows' turns)
    rows: list[Row] = field(default_factory=list)


@dataclass
class Claim:
    claim_id: str
    expires_at: datetime
    sessions: list[ClaimedSession]


async def claim(
    db: AsyncSession,
    run_id: str,
    max_sessions: int,
    lease_s: float,
    group_size: int | None = None,
) -> Claim:
    now = utcnow()
    await _return_expired(db, run_id, now)
    if group_size is not None and group_size > 1:
        candidates = await _whole_groups(db, run_id, max_sessions, group_size)
    else:
        query = (
            select(Session.id)
            .where(Session.run_id == run_id, Session.status == status.TRAINABLE)
            .order_by(Session.trainable_at, Session.id)
            .limit(max_sessions)
            .with_for_update(skip_locked=True)
        )
        candidates = list(await db.scalars(query))
    claim_id, expires = new_id("claim"), now + timedelta(seconds=lease_s)
    if candidates:
        await db.execute(
            update(Session)
            .where(Session.id.in_(candidates), Session.status == status.TRAINABLE)
            .values(status=status.CLAIMED, claim_id=claim_id, claim_expires_at=expires)
        )
        if group_size is not None and group_size > 1:
            await _release_partial_groups(db, claim_id, group_size)
    return Claim(claim_id, expires, await _load(db, claim_id))


async def _return_expired(db: AsyncSession, run_id: str, now: datetime) -> None:
    await db.execute(
        update(Session)
        .where(
            Session.run_id == run_id,
            Session.status == status.CLAIMED,
            Session.claim_expires_at < now,
        )
        .values(status=status.TRAINABLE, claim_id=None, claim_expires_at=None)
    )


async def _whole_groups(
    db: AsyncSession, run_id: str, max_sessions: int, group_size: int
) -> list[str]:
    """Sessions of the oldest groups that have ``group_size`` trainable sessions."""
    trainable = (Session.run_id == run_id, Session.status == status.TRAINABLE)
    groups = await db.execute(
        select(Session.group_id, func.count())
        .where(*trainable, Session.group_id.is_not(None))
        .group_by(Session.group_id)
        .having(func.count() >= group_size)
        .order_by(func.max(Session.trainable_at))
    )
    chosen: list[str] = []
    total = 0
    for group_id, count in groups.all():
        if chosen and total + count > max_sessions:
            break
        chosen.append(str(group_id))
        total += count
    if not chosen:
        return []
    query = select(Session.id).where(*trainable, Session.group_id.in_(chosen))
    return list(await db.scalars(query.with_for_update(skip_locked=True)))


async def _release_partial_groups(db: AsyncSession, claim_id: str, group_size: int) -> None:
    """Another trainer took part of a group at the same moment: give back the rest."""
    counts = await db.execute(
        select(Session.group_id, func.count())
        .where(Session.claim_id == claim_id)
        .group_by(Session.group_id)
    )
    partial = [group for group, count in counts.all() if count < group_size]
    if partial:
        await db.execute(
            update(Session)
            .where(Session.claim_id == claim_id, Session.group_id.in_(partial))
            .values(status=status.TRAINABLE, claim_id=None, claim_expires_at=None)
        )


async def _load(db: AsyncSession, claim_id: str) -> list[ClaimedSession]:
    claimed = list(
        await db.scalars(
            select(Session).where(Session.claim_id == claim_id).order_by(Session.trainable_at)
        )
    )
    return await sessions_with_rows(db, claimed)


async def sessions_with_rows(db: AsyncSession, claimed: list[Session]) -> list[ClaimedSession]:
    """Each session with its training rows and rewards."""
    ids = [s.id for s in claimed]
    if not ids:
        return []
    rewards = await rewards_of(db, ids)
    turns: dict[str, list[Turn]] = {sid: [] for sid in ids}
    query = select(Turn).where(Turn.session_id.in_(ids)).order_by(Turn.turn_index)
    for turn in await db.scalars(query):
        turns[turn.session_id].append(turn)
    out = []
    for session in claimed:
        targets = rewards[session.id]
        tokens = [tokens_of(t, targets.get(t.completion_id)) for t in turns[session.id]]
        out.append(
            ClaimedSession(
                session_id=session.id,
                task_id=session.task_id,
                group_id=session.group_id,
                metadata=session.meta,
                reward=targets.get(SESSION_TARGET),
                rows=assemble_rows(tokens),
            )
        )
    return out


async def confirm(db: AsyncSession, claim_id: str) -> int:
    """Mark a claim's sessions consumed; 0 if its lease ran out and they went back."""
    result = await db.execute(
        update(Session)
        .where(Session.claim_id == claim_id, Session.status == status.CLAIMED)
        .values(status=status.CONSUMED, consumed_at=utcnow())
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def release(db: AsyncSession, claim_id: str) -> int:
    """Give a claim's sessions back to the pool without consuming them."""
    result = await db.execute(
        update(Session)
        .where(Session.claim_id == claim_id, Session.status == status.CLAIMED)
        .values(status=status.TRAINABLE, claim_id=None, claim_expires_at=None)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
