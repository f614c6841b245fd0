"""/rl/sessions: create sessions, read them back, reward them, end them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server import auth, sessions
from server.deps import AdminDep, CallerDep, Ctx, KeyedDep
from server.errors import Forbidden, Unauthorized, documented
from server.schemas import (
    Limit,
    Offset,
    PathId,
    QueryId,
    QueryName,
    RewardIn,
    RewardOut,
    SessionCreate,
    SessionCreated,
    SessionOut,
    SessionStatus,
    SessionSummary,
)

router = APIRouter(prefix="/rl/sessions", tags=["sessions"])


def _ref(path: str, method: str) -> str:
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


# OpenAPI links: where a new session's id goes next (clients and fuzzers follow them).
SESSION_ID = "$response.body#/session_id"
IN_PATH = {"path.session_id": SESSION_ID}
IN_HEADER = {"header.X-Session-Id": SESSION_ID}
SESSION_LINKS = {
    "Chat": (_ref("/sessions/{session_id}/v1/chat/completions", "post"), IN_PATH),
    "Complete": (_ref("/sessions/{session_id}/v1/completions", "post"), IN_PATH),
    "ChatByHeader": (_ref("/v1/chat/completions", "post"), IN_HEADER),
    "CompleteByHeader": (_ref("/v1/completions", "post"), IN_HEADER),
    "Models": (_ref("/sessions/{session_id}/v1/models", "get"), IN_PATH),
    "Get": (_ref("/rl/sessions/{session_id}", "get"), IN_PATH),
    "Reward": (_ref("/rl/sessions/{session_id}/reward", "post"), IN_PATH),
    "End": (_ref("/rl/sessions/{session_id}/end", "post"), IN_PATH),
}
CREATED: dict[int | str, dict[str, Any]] = {
    201: {
        "links": {
            name: {"operationRef": ref, "parameters": parameters}
            for name, (ref, parameters) in SESSION_LINKS.items()
        }
    }
}


@router.post(
    "",
    response_model=SessionCreated,
    status_code=201,
    summary="Start a session (waits for admission, then 429 with Retry-After)",
    responses={**CREATED, **documented(400, 401, 403, 404, 422, 429)},
)
async def create_session(body: SessionCreate, ctx: Ctx, caller: CallerDep) -> SessionCreated:
    if caller.kind == "anonymous":
        raise Unauthorized("Creating a session needs the admin key or a run key.")
    if caller.kind == "session":
        raise Forbidden("A session key cannot create sessions.")
    run_id = body.run_id or caller.run_id or ctx.default_run_id
    auth.require_run_access(caller, run_id)
    return await sessions.create_session(ctx, run_id, body.task_id, body.group_id, body.metadata)


@router.get(
    "",
    response_model=list[SessionSummary],
    summary="List sessions, newest first",
    responses=documented(401, 403, 422),
)
async def list_sessions(
    ctx: Ctx,
    _: AdminDep,
    run_id: QueryId = None,
    status: SessionStatus | None = None,
    task_id: QueryName = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> list[SessionSummary]:
    return await sessions.list_sessions(ctx, run_id, status, task_id, limit, offset)


@router.get(
    "/{session_id}",
    response_model=SessionOut,
    summary="A session, its turns and rows",
    responses=documented(401, 403, 404, 422),
)
async def get_session(session_id: PathId, ctx: Ctx, caller: KeyedDep) -> SessionOut:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    return await sessions.session_view(ctx, session)


@router.post(
    "/{session_id}/reward",
    response_model=RewardOut,
    summary="Reward a session or turn (an ended session is trainable with its session reward)",
    responses=documented(400, 401, 403, 404, 409, 422),
)
async def reward(session_id: PathId, body: RewardIn, ctx: Ctx, caller: KeyedDep) -> RewardOut:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    return await sessions.post_reward(
        ctx, session.run_id, session_id, body.reward, body.completion_id
    )


@router.post("/{session_id}/end", summary="End a session", responses=documented(401, 403, 404, 422))
async def end(session_id: PathId, ctx: Ctx, caller: KeyedDep) -> dict:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    ended = await sessions.end_session(ctx, session_id)
    return {"session_id": session_id, "status": ended.status}
