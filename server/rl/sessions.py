"""Sessions as the REST API sees them: create (admission), show, reward, end.

An eval session (``eval``) is admitted at once, even at the staleness bound: it will never be
trained, so it cannot make training staler. A production session (``production``: traffic the
run serves, its promoted version where it has one, but never trains on) is admitted at once for
the same reason. A group_id holds one kind of session (training, eval or production): a GRPO
group with members that are never trainable would never fill, so mixing is refused. Each eval
session's reward recorded lets the run's promotion gate decide (``server.rl.promotion``): an
eval session counts once rewarded, so only a reward changes the figures it decides on.
"""

from __future__ import annotations

import json
from typing import Any

from server.context import ServerContext
from server.errors import GroupMixesEval, InvalidRequest, RunNotFound, SessionNotFound
from server.rl import promotion
from server.rl import runs as run_views
from server.rl.admission import Held, admits
from server.rl.schemas import RewardOut, RowOut, SessionCreated, SessionOut, SessionSummary, TurnOut
from server.store import claims, rewards, runs, stored_json
from server.store import sessions as store
from server.store.database import Sessionmaker
from server.store.groups import key_of
from server.store.rewards import SESSION_TARGET
from server.store.run_config import RunConfig
from server.store.tables import Session, utcnow
from server.store.turns import served_fields, turns_by_session


async def create_session(
    ctx: ServerContext,
    run_id: str,
    task_id: str | None,
    group_id: str | None,
    metadata: dict,
    eval: bool = False,
    production: bool = False,
) -> SessionCreated:
    """A new session once the run's staleness bound admits it (waits, then 429); an eval or
    production session at once."""
    _check_metadata(metadata, ctx.settings.max_metadata_bytes)
    kind = store.kind_of(eval, production)
    created: list = []

    async def check() -> tuple[bool, RunConfig]:
        # One transaction for the check and the create, under the run's row lock: another
        # server process on the same store cannot take the last place between them (the
        # asyncio lock does the same between this process's own callers, without a wait on
        # the database).
        async with ctx.admission.lock(run_id), ctx.sessionmaker() as db, db.begin():
            run = await runs.lock_run(db, run_id)
            if run is None:
                raise RunNotFound(run_id)
            if group_id is not None:
                others = await store.group_kinds(db, run_id, group_id) - {kind}
                if others:
                    raise GroupMixesEval(group_id, min(others))
            config = RunConfig.model_validate(run.config)
            room = kind != store.TRAINING or config.admission_limit() is None
            if not room:
                size = config.group_size or 1
                rows = await store.held_places(db, run_id)
                held = Held.of(rows, size, utcnow(), config.group_timeout_s)
                room = admits(held, key_of(group_id, task_id, size > 1), config)
            if room:
                created.append(
                    await store.create_session(
                        db, run_id, task_id, group_id, metadata, eval, production
                    )
                )
            return room, config

    await ctx.admission.wait_for_room(check)
    session, key = created[0]
    return SessionCreated(
        session_id=session.id,
        run_id=run_id,
        api_key=key,
        base_url=f"{ctx.settings.base_url}/v1",
        status=session.status,
    )


def _check_metadata(metadata: dict[str, Any], max_bytes: int) -> None:
    """Metadata every reader can serve back: finite numbers (PostgreSQL's JSON has no NaN), and
    at most ``max_bytes`` as UTF-8 JSON (claims and views carry it whole). The door
    (``server.limits``) already refused lone surrogates and deep nesting."""
    try:
        text = json.dumps(metadata, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        raise InvalidRequest(
            "metadata holds NaN or Infinity, which JSON cannot carry; use null or a string",
            param="metadata",
        ) from None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidRequest(
            f"metadata is {size:,} bytes as JSON; at most {max_bytes:,} (max_metadata_bytes): "
            "keep large data elsewhere and put its address here",
            param="metadata",
        )


async def get_session(ctx: ServerContext, session_id: str) -> Session:
    async with ctx.sessionmaker() as db:
        session = await store.get_session(db, session_id)
    if session is None:
        raise SessionNotFound(session_id)
    return session


async def list_sessions(
    ctx: ServerContext,
    run_id: str | None,
    status: str | None,
    task_id: str | None,
    limit: int,
    offset: int,
) -> list[SessionSummary]:
    async with ctx.sessionmaker() as db:
        found = await store.list_sessions(db, run_id, status, task_id, limit, offset)
    return [SessionSummary(**summary_fields(s)) for s in found]


def summary_fields(session: Session) -> dict[str, Any]:
    """The fields of a ``SessionSummary`` (and of the schemas that extend it)."""
    return {
        "session_id": session.id,
        "run_id": session.run_id,
        "task_id": session.task_id,
        "group_id": session.group_id,
        "status": session.status,
        "created_at": session.created_at,
        "ended_at": session.ended_at,
        "turn_count": session.turn_count,
        "row_count": session.row_count,
        "conversations": session.conversations,
        "breaks": session.breaks,
        "drop_reason": session.drop_reason,
        "eval": session.eval,
        "production": session.production,
    }


async def session_view(ctx: ServerContext, session: Session) -> SessionOut:
    """The session with its turns (exact tokens) and the training rows built from them."""
    (view,) = await session_views(ctx.sessionmaker, [session])
    return view


async def session_views(sessionmaker: Sessionmaker, found: list[Session]) -> list[SessionOut]:
    """:func:`session_view` of several sessions, a few queries for them all, from the store
    itself (``proxrl export`` reads a page of sessions at a time, without a server)."""
    ids = [session.id for session in found]
    async with sessionmaker() as db:
        turns = await turns_by_session(db, ids)
        targets = await rewards.rewards_of(db, ids)
        claimed = await claims.sessions_with_rows(db, found)
    views = []
    for session, with_rows in zip(found, claimed, strict=True):
        withheld: dict[str, str] = {}
        metadata = _servable(session.meta, "metadata", withheld)
        served = [
            _servable_turn(served_fields(t), i, withheld) for i, t in enumerate(turns[session.id])
        ]
        views.append(
            SessionOut(
                **summary_fields(session),
                metadata=metadata if metadata is not None else {},
                withheld=withheld,
                reward=targets[session.id].get(SESSION_TARGET),
                rewards=targets[session.id],
                turns=[
                    TurnOut(
                        **fields,
                        reward=targets[session.id].get(t.completion_id),
                        created_at=t.created_at,
                    )
                    for t, fields in zip(turns[session.id], served, strict=True)
                ],
                rows=[RowOut(**vars(row)) for row in with_rows.rows],
                retries=with_rows.retries,
            )
        )
    return views


# A turn's free-form values, as its request and answer stored them.
_TURN_JSON = ("messages", "tools", "response", "sampling")


def _servable(value: Any, name: str, withheld: dict[str, str]) -> Any:
    """``value``, or None (its problem noted in ``withheld`` under ``name``) when an older
    version stored what no answer can carry (``stored_json.problem``)."""
    problem = stored_json.problem(value)
    if problem is None:
        return value
    withheld[name] = problem
    return None


def _servable_turn(fields: dict[str, Any], index: int, withheld: dict[str, str]) -> dict[str, Any]:
    for name in _TURN_JSON:
        value = _servable(fields[name], f"turns[{index}].{name}", withheld)
        if value is None and fields[name] is not None:
            value = {} if isinstance(fields[name], dict) else []
        fields[name] = value
    return fields


async def post_reward(
    ctx: ServerContext, run_id: str, session_id: str, value: float, completion_id: str | None
) -> RewardOut:
    suffice = (await run_views.run_config(ctx, run_id)).turn_rewards_suffice
    promoted = None
    async with ctx.sessionmaker() as db, db.begin():
        session = await store.get_session(db, session_id)
        if session is None:
            raise SessionNotFound(session_id)
        reward, created = await rewards.add_reward(
            db, session, float(value), completion_id, suffice
        )
        status = session.status
        if session.eval and created:
            promoted = await promotion.decide(db, run_id)
    if promoted is not None:
        ctx.run_adapters.forget(run_id)
    ctx.sessions.set_status(session_id, status)
    return RewardOut(
        session_id=session_id,
        target=reward.target,
        reward=reward.value,
        created=created,
        status=status,
    )


async def end_session(ctx: ServerContext, session_id: str) -> Session:
    async with ctx.sessionmaker() as db, db.begin():
        session = await store.get_session(db, session_id)
        if session is None:
            raise SessionNotFound(session_id)
        await store.end_session(db, session)
    ctx.sessions.set_status(session_id, session.status)
    return session
