"""The RL REST surface: /rl/runs, /rl/sessions, /rl/claims (the trainer's), /admin (weights,
engines). Thin: each route checks who calls and hands over to the module named for its concept
(``runs``, ``sessions``, ``claims``, ``steps``, ``weights``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import Response, StreamingResponse

from server import auth
from server.bounds import Limit, Name, Offset, PathId, QueryId, QueryName
from server.deps import AdminDep, BodyOffLoop, CallerDep, Ctx, KeyedDep
from server.errors import AuthenticationRequired, KeyOutOfScope, documented
from server.export.options import SINCE_HELP, STATUS_HELP, ExportFormat, ExportStatus, Since
from server.export.writers import FORMATS
from server.rl import (
    adapters,
    claims,
    export,
    promotion,
    rollback,
    runs,
    sessions,
    steps,
    weights,
    weights_probe,
)
from server.rl.schemas import (
    ClaimIn,
    ClaimOut,
    ConfirmIn,
    ConfirmOut,
    DropIn,
    DropOut,
    LeaderOut,
    LeaderView,
    PromoteIn,
    ReleaseOut,
    RenewIn,
    RenewOut,
    RewardIn,
    RewardOut,
    RollbackIn,
    RunCreate,
    RunCreated,
    RunOut,
    RunVersionOut,
    SessionCreate,
    SessionCreated,
    SessionEnded,
    SessionOut,
    SessionStatus,
    SessionSummary,
    StepIn,
    StepOut,
    TrainedIn,
    TrainedOut,
    WeightGroupIn,
    WeightsIn,
    WeightsOut,
)
from server.store import leadership
from server.store import runs as store_runs

sessions_router = APIRouter(prefix="/rl/sessions", tags=["sessions"], route_class=BodyOffLoop)


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


@sessions_router.post(
    "",
    response_model=SessionCreated,
    status_code=201,
    summary="Start a session (waits for admission, then 429 with Retry-After; eval and "
    "production: at once)",
    responses={**CREATED, **documented(400, 401, 403, 404, 409, 422, 429)},
)
async def create_session(body: SessionCreate, ctx: Ctx, caller: CallerDep) -> SessionCreated:
    if caller.kind == "anonymous":
        raise AuthenticationRequired("Creating a session needs the admin key or a run key.")
    if caller.kind == "session":
        raise KeyOutOfScope("A session key cannot create sessions.")
    run_id = body.run_id or caller.run_id or ctx.default_run_id
    auth.require_run_access(caller, run_id)
    return await sessions.create_session(
        ctx, run_id, body.task_id, body.group_id, body.metadata, body.eval, body.production
    )


@sessions_router.get(
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


@sessions_router.get(
    "/{session_id}",
    response_model=SessionOut,
    summary="A session, its turns and rows",
    responses=documented(401, 403, 404, 422),
)
async def get_session(session_id: PathId, ctx: Ctx, caller: KeyedDep) -> SessionOut:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    return await sessions.session_view(ctx, session)


@sessions_router.post(
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


@sessions_router.post(
    "/{session_id}/end",
    response_model=SessionEnded,
    summary="End a session",
    responses=documented(401, 403, 404, 422),
)
async def end(session_id: PathId, ctx: Ctx, caller: KeyedDep) -> SessionEnded:
    session = await sessions.get_session(ctx, session_id)
    auth.require_session_access(caller, session.run_id, session.id)
    ended = await sessions.end_session(ctx, session_id)
    return SessionEnded(session_id=session_id, status=ended.status)


runs_router = APIRouter(prefix="/rl", tags=["runs"], route_class=BodyOffLoop)


@runs_router.post(
    "/runs",
    response_model=RunCreated,
    status_code=201,
    summary="Create a run",
    responses=documented(400, 401, 403, 422),
)
async def create_run(body: RunCreate, ctx: Ctx, _: AdminDep) -> dict:
    run, key = await runs.create_run(ctx, body.name, body.config)
    return {**await runs.run_view(ctx, run), "api_key": key}


@runs_router.get(
    "/runs", response_model=list[RunOut], summary="List runs", responses=documented(401, 403, 422)
)
async def list_runs(ctx: Ctx, _: AdminDep, limit: Limit = 100, offset: Offset = 0) -> list[dict]:
    async with ctx.sessionmaker() as db:
        found = await store_runs.list_runs(db, limit, offset)
    return [await runs.run_view(ctx, run) for run in found]


@runs_router.get(
    "/runs/{run_id}",
    response_model=RunOut,
    summary="A run, its counts, version and held-out (eval) rewards by version",
    responses=documented(401, 403, 404, 422),
)
async def get_run(run_id: PathId, ctx: Ctx, caller: KeyedDep) -> dict:
    run = await runs.get_run(ctx, run_id)
    auth.require_run_access(caller, run.id)
    return await runs.run_view(ctx, run)


EXPORTED = {
    "description": "The export file: JSON Lines, or Parquet (a row group per page of sessions). "
    "X-Export-Sessions says how many sessions it holds when it starts.",
    "content": {"application/x-ndjson": {}, "application/vnd.apache.parquet": {}},
}


@runs_router.get(
    "/runs/{run_id}/export",
    response_class=StreamingResponse,
    summary="A run's sessions with their turns and rows, streamed as JSONL or Parquet",
    responses={200: EXPORTED, **documented(400, 401, 403, 404, 422)},
)
async def export_run(
    run_id: PathId,
    ctx: Ctx,
    _: AdminDep,
    status: Annotated[ExportStatus, Query(description=STATUS_HELP)] = "consumed",
    since: Annotated[Since | None, Query(description=SINCE_HELP)] = None,
    format: ExportFormat = "jsonl",
) -> StreamingResponse:
    await runs.get_run(ctx, run_id)  # a 404 before the first byte
    chosen = export.chosen_sessions(run_id, status, since)
    writer = FORMATS[format]()
    total = await export.count(ctx.sessionmaker, chosen)
    return StreamingResponse(
        export.file_chunks(ctx.sessionmaker, chosen, writer),
        media_type=writer.media_type,
        headers={
            "X-Export-Sessions": str(total),
            "Content-Disposition": f'attachment; filename="{run_id}.{format}"',
        },
    )


@runs_router.patch(
    "/runs/{run_id}",
    response_model=RunOut,
    summary="Change a run's config",
    responses=documented(400, 401, 403, 404, 422),
)
async def patch_run(
    run_id: PathId,
    ctx: Ctx,
    _: AdminDep,
    config: Annotated[dict[Name, Any], Body(embed=True, max_length=1000)],
) -> dict:
    return await runs.run_view(ctx, await runs.update_config(ctx, run_id, config))


@runs_router.get(
    "/runs/{run_id}/versions",
    response_model=list[RunVersionOut],
    summary="A run's published versions, oldest first: the lineage (parent, rollback source)",
    responses=documented(401, 403, 404, 422),
)
async def run_versions(run_id: PathId, ctx: Ctx, caller: KeyedDep) -> list[RunVersionOut]:
    run = await runs.get_run(ctx, run_id)
    auth.require_run_access(caller, run.id)
    return await rollback.lineage(ctx, run)


@runs_router.post(
    "/runs/{run_id}/rollback",
    response_model=WeightsOut,
    summary="Serve an earlier version's weights again, published as the run's next version",
    responses=documented(400, 401, 403, 404, 409, 410, 422, 502, 503),
)
async def rollback_run(
    run_id: PathId, body: RollbackIn, ctx: Ctx, _: AdminDep, request: Request
) -> Any:
    if not ctx.pool.leading:  # a follower: the leader swaps
        return leaders_answer(await weights.forward(ctx, request.url.path, body, request.headers))
    return await rollback.rollback(ctx, run_id, body.version)


@runs_router.post(
    "/runs/{run_id}/promote",
    response_model=RunOut,
    summary="Serve the run's production sessions a version (a promotion by hand)",
    responses=documented(400, 401, 403, 404, 409, 410, 422),
)
async def promote(run_id: PathId, body: PromoteIn, ctx: Ctx, _: AdminDep) -> dict:
    return await runs.run_view(ctx, await promotion.promote(ctx, run_id, body.version))


@runs_router.post(
    "/runs/{run_id}/claims",
    response_model=ClaimOut,
    summary="Claim trainable sessions",
    responses=documented(400, 401, 403, 404, 422),
)
async def claim(run_id: PathId, body: ClaimIn, ctx: Ctx, _: AdminDep) -> ClaimOut:
    run = await runs.get_run(ctx, run_id)
    return await claims.claim(ctx, run, body.max_sessions, body.lease_s, body.group_size)


@runs_router.post(
    "/runs/{run_id}/steps",
    response_model=StepOut,
    status_code=201,
    summary="Record a trainer step's figures (reposting a step replaces them)",
    responses=documented(400, 401, 403, 404, 422),
)
async def record_step(run_id: PathId, body: StepIn, ctx: Ctx, _: AdminDep) -> StepOut:
    return await steps.record(ctx, run_id, body)


@runs_router.post(
    "/claims/renew",
    response_model=RenewOut,
    summary="Hold claims longer (sessions back in the pool after a lapse too, if not retaken)",
    responses=documented(400, 401, 403, 422),
)
async def renew_claims(body: RenewIn, ctx: Ctx, _: AdminDep) -> RenewOut:
    return await claims.renew(ctx, body.claim_ids, body.lease_s)


@runs_router.post(
    "/claims/{claim_id}/confirm",
    response_model=ConfirmOut,
    summary="Mark a claim's sessions consumed, or dropped with a reason",
    responses=documented(400, 401, 403, 404, 422),
)
async def confirm_claim(
    claim_id: PathId, ctx: Ctx, _: AdminDep, body: ConfirmIn | None = None
) -> ConfirmOut:
    return await claims.confirm(ctx, claim_id, body.dropped if body is not None else {})


@runs_router.post(
    "/claims/{claim_id}/trained",
    response_model=TrainedOut,
    summary="Mark a claim's sessions trained by a step (they free their admission places)",
    responses=documented(400, 401, 403, 404, 422),
)
async def claim_trained(claim_id: PathId, body: TrainedIn, ctx: Ctx, _: AdminDep) -> TrainedOut:
    return await claims.mark_trained(ctx, claim_id, body.version)


@runs_router.post(
    "/claims/{claim_id}/drop",
    response_model=DropOut,
    summary="Drop sessions of a claim now, each with its reason (before the claim is confirmed)",
    responses=documented(400, 401, 403, 404, 422),
)
async def drop_from_claim(claim_id: PathId, body: DropIn, ctx: Ctx, _: AdminDep) -> DropOut:
    return await claims.drop(ctx, claim_id, body.dropped)


@runs_router.post(
    "/claims/{claim_id}/release",
    response_model=ReleaseOut,
    summary="Give a claim's sessions back",
    responses=documented(401, 403, 404, 422),
)
async def release_claim(claim_id: PathId, ctx: Ctx, _: AdminDep) -> ReleaseOut:
    return await claims.release(ctx, claim_id)


admin_router = APIRouter(
    prefix="/admin", tags=["admin"], responses=documented(401, 403), route_class=BodyOffLoop
)


@admin_router.post(
    "/weights",
    response_model=WeightsOut,
    summary="Swap new weights into every engine",
    responses=documented(400, 404, 409, 422, 502, 503),
)
async def publish_weights(body: WeightsIn, ctx: Ctx, _: AdminDep, request: Request) -> Any:
    if not ctx.pool.leading:  # a follower: the leader swaps
        return leaders_answer(await weights.forward(ctx, request.url.path, body, request.headers))
    if body.adapter_path is not None:  # a version of a LoRA run: loaded beside the others
        return await adapters.publish(ctx, body)
    return await weights.publish(ctx, body)


@admin_router.post(
    "/weights/group",
    response_model=dict[str, Any],
    summary="Have every engine join the trainer's weight group",
    responses=documented(400, 409, 422, 502, 503),
)
async def weight_group(body: WeightGroupIn, ctx: Ctx, _: AdminDep, request: Request) -> Any:
    if not ctx.pool.leading:
        return leaders_answer(await weights.forward(ctx, request.url.path, body, request.headers))
    return await weights.form_group(ctx, body)


@admin_router.post(
    "/weights/probe",
    response_model=weights_probe.WeightsProbeOut,
    summary="Whether this server and its engines can read a file the trainer wrote",
    responses=documented(400, 422, 502, 503),
)
async def probe_weights(
    body: weights_probe.WeightsProbeIn, ctx: Ctx, _: AdminDep, request: Request
) -> Any:
    if not ctx.pool.leading:  # the leader checks a publish's files: it is the one to ask
        return leaders_answer(await weights.forward(ctx, request.url.path, body, request.headers))
    return await weights_probe.probe(ctx, body)


def leaders_answer(forwarded: weights.Forwarded) -> Response:
    return Response(forwarded.content, forwarded.status, headers=forwarded.headers)


@admin_router.get(
    "/leader",
    response_model=LeaderOut,
    summary="Which replica leads (swaps weights, judges the engines' versions), and this one",
    responses=documented(503),
)
async def leader(ctx: Ctx, _: AdminDep) -> LeaderOut:
    async with ctx.sessionmaker() as db:
        current = await leadership.current_leader(db)
    return LeaderOut(
        replica_id=ctx.replica_id,
        leading=ctx.pool.leading,
        leader=None if current is None else LeaderView(**vars(current)),
    )


@admin_router.get("/engines", summary="Each engine's URL, health, load and served version")
async def engines(ctx: Ctx, _: AdminDep) -> list[dict]:
    return [
        {
            "url": e.url,
            "healthy": e.healthy,
            "in_flight": e.in_flight,
            "weight_version": e.weight_version,
            "context_length": e.context_length,
            "tp_size": e.tp_size,
            "served_tokens": e.served_tokens,
            "failures": e.failures,
            "last_error": e.last_error,
        }
        for e in ctx.pool.engines
    ]


ROUTERS = (sessions_router, runs_router, admin_router)
