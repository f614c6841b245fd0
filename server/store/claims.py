"""The trainer's reader: claim trainable sessions exactly once, renew, confirm, drop or release
them.

A claim marks sessions ``claimed`` with a lease and its ``claim_id``. Confirming marks them
``consumed`` (or ``dropped``, with the trainer's reason); dropping some before the confirm marks
them ``dropped`` at once; releasing gives them back. Marking a claim trained (a step trained it,
before the checkpoint that confirms it) records the step's version on its sessions, which frees
their admission places (``server.rl.admission``). Dropped and consumed sessions keep the
claim's id, so a confirm counts them as settled. A lease that runs out returns the sessions to
``trainable`` but they keep the claim's id, so its owner can still renew, drop or confirm them
until another claim takes them (which overwrites the id).

Every claim first drops the run's trainable sessions that have no turn, then takes the oldest
whole groups (``server.store.groups``: by group_id always, by task_id too under a group_size >
1, a session without a key alone). Two trainers never get the same session and a group is never
split: SQLite serialises writers (each write transaction here starts with a write), and on
Postgres the chosen sessions are locked with SKIP LOCKED; a group of which fewer were locked
than chosen is left alone, and the claim goes on to the next groups. Claimed sessions come back
as training rows; one whose stored metadata no answer can carry (an older version's lone
surrogate or deep nesting: ``stored_json``) is dropped instead, with its reason, in the same
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.errors import ClaimNotFound, NotInClaim
from server.store import drop_reasons, groups, stored_json
from server.store import sessions as status
from server.store.keys import new_id
from server.store.rewards import SESSION_TARGET, rewards_of
from server.store.rows import Row, assemble_rows, retries
from server.store.tables import Session, utcnow
from server.store.turns import tokens_of, turns_by_session

HELD = (status.CLAIMED, status.TRAINABLE)  # with the claim's id: held, or lapsed and not retaken
SETTLED = (status.CONSUMED, status.DROPPED)


@dataclass
class ClaimedSession:
    session_id: str
    task_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    reward: float | None  # the session's reward (turn rewards are on the rows' turns)
    rows: list[Row] = field(default_factory=list)
    retries: int = 0  # requests retried: attempts the session did not go on from


@dataclass
class Claim:
    claim_id: str
    expires_at: datetime
    sessions: list[ClaimedSession]
    dropped: int = 0  # sessions this claim dropped (no turns, incomplete groups)


@dataclass(frozen=True)
class Settlement:
    consumed: int  # newly consumed
    dropped: int  # newly dropped
    settled: int  # every session with the claim's id now consumed or dropped


@dataclass(frozen=True)
class Drops:
    dropped: int  # newly dropped
    held: int  # the claim's sessions still claimed


async def claim(
    db: AsyncSession, run_id: str, max_sessions: int, lease_s: float, rule: groups.GroupRule
) -> Claim:
    """Claim up to ``max_sessions`` of the run's oldest trainable sessions, in whole groups, for
    ``lease_s`` seconds."""
    now = utcnow()
    await _return_lapsed(db, run_id, now)
    dropped = await _drop_without_turns(db, run_id)
    chosen, dropped_groups = await _whole_groups(db, run_id, max_sessions, rule, now)
    dropped += dropped_groups
    claim_id, expires = new_id("claim"), now + timedelta(seconds=lease_s)
    if chosen:
        await db.execute(
            update(Session)
            .where(Session.id.in_(chosen), Session.status == status.TRAINABLE)
            .values(status=status.CLAIMED, claim_id=claim_id, claim_expires_at=expires)
        )
    claimed = await _load(db, claim_id)
    unservable = {
        c.session_id: drop_reasons.unservable(problem)
        for c in claimed
        if (problem := stored_json.problem(c.metadata)) is not None
    }
    if unservable:  # dropped as the trainer drops: they keep the claim's id, and count settled
        dropped += await _drop(db, unservable)
        claimed = [c for c in claimed if c.session_id not in unservable]
    return Claim(claim_id, expires, claimed, dropped)


def _trainable(run_id: str) -> tuple:
    # Eval and production sessions never become trainable; the flags are checked as well, so
    # that no claim could ever take one.
    return (
        Session.run_id == run_id,
        Session.status == status.TRAINABLE,
        Session.eval.is_(False),
        Session.production.is_(False),
    )


async def _return_lapsed(db: AsyncSession, run_id: str, now: datetime) -> None:
    """Claims whose lease ran out go back to the pool; their sessions keep the claim's id."""
    await db.execute(
        update(Session)
        .where(
            Session.run_id == run_id,
            Session.status == status.CLAIMED,
            Session.claim_expires_at < now,
        )
        .values(status=status.TRAINABLE)
    )


async def _drop_without_turns(db: AsyncSession, run_id: str) -> int:
    """A session that never called the model has nothing to train."""
    result = await db.execute(
        update(Session)
        .where(*_trainable(run_id), Session.turn_count == 0)
        .values(status=status.DROPPED, drop_reason=drop_reasons.NO_TURNS, claim_id=None)
    )
    return _count(result)


async def _whole_groups(
    db: AsyncSession, run_id: str, max_sessions: int, rule: groups.GroupRule, now: datetime
) -> tuple[list[str], int]:
    """The sessions of the groups to claim, and how many sessions of resolved incomplete groups
    were dropped. A group only part of which could be locked (a concurrent claim holds the
    rest) is left for a later claim, and the plan goes on with the groups after it."""
    found = await db.execute(
        select(Session.id, Session.group_id, Session.task_id, Session.trainable_at).where(
            *_trainable(run_id), Session.turn_count > 0
        )
    )
    candidates = [
        groups.Candidate(session_id, group_id, task_id, trainable_at or now)
        for session_id, group_id, task_id, trainable_at in found
    ]
    chosen: list[str] = []
    dropped = 0
    while True:
        plan = groups.plan_claim(candidates, rule, max_sessions, now, already=len(chosen))
        planned = [*plan.claim, *(group for group, _ in plan.drop)]
        planned_ids = {sid for group in planned for sid in group.session_ids}
        locked = await _lock(db, sorted(planned_ids))
        to_drop = {
            sid: reason
            for group, reason in plan.drop
            if locked.issuperset(group.session_ids)
            for sid in group.session_ids
        }
        dropped += await _drop(db, to_drop, claim_id=None)
        chosen += [
            sid
            for group in plan.claim
            if locked.issuperset(group.session_ids)
            for sid in group.session_ids
        ]
        if len(locked) == len(planned_ids):
            return chosen, dropped
        candidates = [c for c in candidates if c.session_id not in planned_ids]


async def _lock(db: AsyncSession, session_ids: list[str]) -> set[str]:
    """Those of ``session_ids`` still trainable that no concurrent claim holds, now locked."""
    if not session_ids:
        return set()
    query = select(Session.id).where(
        Session.id.in_(session_ids), Session.status == status.TRAINABLE
    )
    return set(await db.scalars(query.with_for_update(skip_locked=True)))


async def _drop(db: AsyncSession, reasons: dict[str, str], *where: Any, **values: Any) -> int:
    """Drop the sessions that also meet ``where``, each with its reason (one statement per
    distinct reason); how many were dropped."""
    by_reason: dict[str, list[str]] = {}
    for session_id, reason in reasons.items():
        by_reason.setdefault(reason, []).append(session_id)
    dropped = 0
    for reason, ids in by_reason.items():
        result = await db.execute(
            update(Session)
            .where(Session.id.in_(ids), *where)
            .values(status=status.DROPPED, drop_reason=reason, **values)
        )
        dropped += _count(result)
    return dropped


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
    turns = await turns_by_session(db, ids)
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
                retries=retries(tokens),
            )
        )
    return out


async def renew(db: AsyncSession, claim_ids: list[str], expires: datetime) -> dict[str, int]:
    """Hold the claims' sessions until ``expires``, those that lapsed included while no other
    claim took them; how many each claim now holds."""
    await db.execute(
        update(Session)
        .where(Session.claim_id.in_(claim_ids), Session.status.in_(HELD))
        .values(status=status.CLAIMED, claim_expires_at=expires)
    )
    counts = await db.execute(
        select(Session.claim_id, func.count())
        .where(Session.claim_id.in_(claim_ids), Session.status == status.CLAIMED)
        .group_by(Session.claim_id)
    )
    held = {claim_id: 0 for claim_id in claim_ids}
    held.update({str(claim_id): int(count) for claim_id, count in counts.all()})
    return held


async def runs_of(db: AsyncSession, claim_ids: list[str]) -> list[str]:
    """The runs of the sessions the claims hold (one, unless the ids span runs)."""
    query = (
        select(Session.run_id)
        .where(Session.claim_id.in_(claim_ids), Session.status.in_(HELD))
        .distinct()
    )
    return list(await db.scalars(query))


def _held(claim_id: str) -> tuple[ColumnElement[bool], ...]:
    """The claim's sessions it can still settle: claimed, or lapsed and not retaken."""
    return (Session.claim_id == claim_id, Session.status.in_(HELD))


async def mark_trained(db: AsyncSession, claim_id: str, version: int) -> int:
    """A training step that published ``version`` trained the claim's sessions (held, or lapsed
    and not retaken): the ones no step trained before get ``trained_version``, and hold no
    admission place from now on. How many of the claim's held sessions are now marked; marking
    again changes nothing (a session keeps the version of the first step that trained it, even
    when a restart hands it back to be trained again: its place was freed once).

    A claim id no session carries (never issued, or every session released or retaken by
    another claim) raises :class:`ClaimNotFound`; a claim whose sessions are all settled is
    known, and marks none."""
    await db.execute(
        update(Session)
        .where(*_held(claim_id), Session.trained_version.is_(None))
        .values(trained_version=version)
    )
    marked = await db.scalar(
        select(func.count()).where(*_held(claim_id), Session.trained_version.is_not(None))
    )
    if not marked and not await _carried(db, claim_id):
        raise ClaimNotFound(claim_id)
    return int(marked or 0)


async def _carried(db: AsyncSession, claim_id: str) -> bool:
    """Does any session carry the claim's id (held, lapsed, or settled by it)?"""
    found = await db.scalar(select(Session.id).where(Session.claim_id == claim_id).limit(1))
    return found is not None


async def confirm(db: AsyncSession, claim_id: str, dropped: dict[str, str]) -> Settlement:
    """The claim's sessions (held, or lapsed and not retaken) become consumed, except those in
    ``dropped``, which become dropped with their reason. Confirming again changes nothing.

    A session named in ``dropped`` that is not the claim's raises :class:`NotInClaim` (see
    :func:`_check_named`)."""
    newly_dropped = await _drop(db, dropped, *_held(claim_id))  # a write first: see the module doc
    result = await db.execute(
        update(Session).where(*_held(claim_id)).values(status=status.CONSUMED, consumed_at=utcnow())
    )
    await _check_named(db, claim_id, list(dropped))
    settled = await db.scalar(
        select(func.count()).where(Session.claim_id == claim_id, Session.status.in_(SETTLED))
    )
    return Settlement(_count(result), newly_dropped, int(settled or 0))


async def drop(db: AsyncSession, claim_id: str, dropped: dict[str, str]) -> Drops:
    """The named sessions the claim holds (or that lapsed and were not retaken) become dropped
    with their reason now, before the claim is confirmed. They keep the claim's id, so a later
    confirm counts them as settled; dropping again changes nothing. A named session that is not
    the claim's raises :class:`NotInClaim`."""
    newly_dropped = await _drop(db, dropped, *_held(claim_id))  # a write first: see the module doc
    await _check_named(db, claim_id, list(dropped))
    held = await db.scalar(
        select(func.count()).where(Session.claim_id == claim_id, Session.status == status.CLAIMED)
    )
    return Drops(newly_dropped, int(held or 0))


async def _check_named(db: AsyncSession, claim_id: str, session_ids: list[str]) -> None:
    """Every named session must carry the claim's id, or be claimed now by another claim of the
    same run (it lapsed and was retaken: that claim's to settle, so it is left alone; when every
    session of the claim was retaken, its run is unknown and any claimed session passes).
    Anything else (an unknown id, a session never claimed, released, settled by another claim,
    or of another run) raises :class:`NotInClaim`."""
    if not session_ids:
        return
    runs = set(
        await db.scalars(select(Session.run_id).where(Session.claim_id == claim_id).distinct())
    )
    found = await db.execute(
        select(Session.id, Session.claim_id, Session.status, Session.run_id).where(
            Session.id.in_(session_ids)
        )
    )
    accepted = {
        session_id
        for session_id, held_by, state, run_id in found
        if held_by == claim_id or (state == status.CLAIMED and (not runs or run_id in runs))
    }
    missing = sorted(set(session_ids) - accepted)
    if missing:
        raise NotInClaim(claim_id, missing)


async def release(db: AsyncSession, claim_id: str) -> int:
    """Give a claim's sessions (held, or lapsed and not retaken) back to the pool."""
    result = await db.execute(
        update(Session)
        .where(*_held(claim_id))
        .values(status=status.TRAINABLE, claim_id=None, claim_expires_at=None)
    )
    return _count(result)


def _count(result: Any) -> int:
    return int(result.rowcount or 0)
