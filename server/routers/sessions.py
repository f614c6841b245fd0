"""/rl/sessions: create sessions, read them back, reward them, end them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from server import auth, sessions
from server.deps import AdminDep, CallerDep, Ctx, KeyedDep
from server.errors import Forbidden, Unauthorized
from server.schemas import (
    RewardIn,
    RewardOut,
    SessionCreate,
    SessionCreated,
    SessionOut,
    SessionStatus,
    SessionSummary,
)

router = APIRouter(prefix="/rl/sessions", tags=["sessions"])


@router.post("", response_model=SessionCreated, status_code=201, summary="Start a session")
async def create_session(body: SessionCreate, ctx: Ctx, caller: CallerDep) -> SessionCreated:
    if caller.kind == "anonymous":
        raise Unauthorized("Creating a session needs the admin key or a run key.")
    if caller.kind == "session":
        raise Forbidden("A session key cannot create sessions.")
    run_id = body.run_id or caller.run_id or ctx.default_run_id
    auth.require_run_access(caller, run_id)
    return await sessions.create_session(ctx, run_id, body.task_id, body.group_id, body.metadata)


@router.get("", response_model=list[SessionSummary], summary="List sessions, newest first")
async def list_sessions(
    ctx: Ctx,
    _: AdminDep,
    run_id: str | None = None,
    status: SessionStatus | None = None,
    task_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[SessionSummary]:
    return await sessions.list_sessions(ctx, run_id, status, task_id, limit, offset)


@router.get("/{session_id}", response_model=SessionOut, summary="A session, its turns and rows")
async def get_session(session_id: str, ctx: Ctx, caller: KeyedDep) -> SessionOut:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    return await sessions.session_view(ctx, session)


@router.post(
    "/{session_id}/reward",
    response_model=RewardOut,
    summary="Reward a session or turn (an ended session is trainable with its session reward)",
)
async def reward(session_id: str, body: RewardIn, ctx: Ctx, caller: KeyedDep) -> RewardOut:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    return await sessions.post_reward(
        ctx, session.run_id, session_id, body.reward, body.completion_id
    )


@router.post("/{session_id}/end", summary="End a session")
async def end(session_id: str, ctx: Ctx, caller: KeyedDep) -> dict:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    ended = await sessions.end_session(ctx, session_id)
    return {"session_id": session_id, "status": ended.status}
