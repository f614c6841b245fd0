"""/rl/runs and /rl/claims: runs, their config, and the trainer's claims."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from server import auth, runs, steps
from server.deps import AdminDep, Ctx, KeyedDep
from server.errors import documented
from server.schemas import (
    ClaimIn,
    ClaimOut,
    ConfirmIn,
    ConfirmOut,
    DropIn,
    DropOut,
    Limit,
    Name,
    Offset,
    PathId,
    ReleaseOut,
    RenewIn,
    RenewOut,
    RunCreate,
    RunCreated,
    RunOut,
    StepIn,
    StepOut,
)
from server.store import runs as store_runs

router = APIRouter(prefix="/rl", tags=["runs"])


@router.post(
    "/runs",
    response_model=RunCreated,
    status_code=201,
    summary="Create a run",
    responses=documented(400, 401, 403, 422),
)
async def create_run(body: RunCreate, ctx: Ctx, _: AdminDep) -> dict:
    run, key = await runs.create_run(ctx, body.name, body.config)
    return {**await runs.run_view(ctx, run), "api_key": key}


@router.get(
    "/runs", response_model=list[RunOut], summary="List runs", responses=documented(401, 403, 422)
)
async def list_runs(ctx: Ctx, _: AdminDep, limit: Limit = 100, offset: Offset = 0) -> list[dict]:
    async with ctx.sessionmaker() as db:
        found = await store_runs.list_runs(db, limit, offset)
    return [await runs.run_view(ctx, run) for run in found]


@router.get(
    "/runs/{run_id}",
    response_model=RunOut,
    summary="A run, its counts and version",
    responses=documented(401, 403, 404, 422),
)
async def get_run(run_id: PathId, ctx: Ctx, caller: KeyedDep) -> dict:
    run = await runs.get_run(ctx, run_id)
    auth.require_run_access(caller, run.id)
    return await runs.run_view(ctx, run)


@router.patch(
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


@router.post(
    "/runs/{run_id}/claims",
    response_model=ClaimOut,
    summary="Claim trainable sessions",
    responses=documented(400, 401, 403, 404, 422),
)
async def claim(run_id: PathId, body: ClaimIn, ctx: Ctx, _: AdminDep) -> ClaimOut:
    run = await runs.get_run(ctx, run_id)
    return await runs.claim(ctx, run, body.max_sessions, body.lease_s, body.group_size)


@router.post(
    "/runs/{run_id}/steps",
    response_model=StepOut,
    status_code=201,
    summary="Record a trainer step's figures (reposting a step replaces them)",
    responses=documented(400, 401, 403, 404, 422),
)
async def record_step(run_id: PathId, body: StepIn, ctx: Ctx, _: AdminDep) -> StepOut:
    return await steps.record(ctx, run_id, body)


@router.post(
    "/claims/renew",
    response_model=RenewOut,
    summary="Hold claims longer (sessions back in the pool after a lapse too, if not retaken)",
    responses=documented(400, 401, 403, 422),
)
async def renew_claims(body: RenewIn, ctx: Ctx, _: AdminDep) -> RenewOut:
    return await runs.renew(ctx, body.claim_ids, body.lease_s)


@router.post(
    "/claims/{claim_id}/confirm",
    response_model=ConfirmOut,
    summary="Mark a claim's sessions consumed, or dropped with a reason",
    responses=documented(400, 401, 403, 404, 422),
)
async def confirm_claim(
    claim_id: PathId, ctx: Ctx, _: AdminDep, body: ConfirmIn | None = None
) -> ConfirmOut:
    return await runs.confirm(ctx, claim_id, body.dropped if body is not None else {})


@router.post(
    "/claims/{claim_id}/drop",
    response_model=DropOut,
    summary="Drop sessions of a claim now, each with its reason (before the claim is confirmed)",
    responses=documented(400, 401, 403, 404, 422),
)
async def drop_from_claim(claim_id: PathId, body: DropIn, ctx: Ctx, _: AdminDep) -> DropOut:
    return await runs.drop(ctx, claim_id, body.dropped)


@router.post(
    "/claims/{claim_id}/release",
    response_model=ReleaseOut,
    summary="Give a claim's sessions back",
    responses=documented(401, 403, 404, 422),
)
async def release_claim(claim_id: PathId, ctx: Ctx, _: AdminDep) -> ReleaseOut:
    return await runs.release(ctx, claim_id)
