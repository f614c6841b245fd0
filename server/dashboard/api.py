"""/admin/api: the dashboard's figures as JSON, for the dashboard and for your own views.

Every route needs the admin key (bearer, or the dashboard's login cookie) and is read-only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from server.bounds import MAX_INT, Offset, PathId, QueryId, QueryName
from server.dashboard import views
from server.dashboard.access import ApiAdmin
from server.dashboard.schemas import (
    EngineRow,
    RunDetail,
    RunSeries,
    RunsPage,
    SessionDetail,
    SessionsPage,
)
from server.deps import Ctx
from server.errors import documented
from server.rl.schemas import SessionStatus
from server.store.run_config import REWARD_BOUND
from server.store.stats import SessionFilter

router = APIRouter(
    prefix="/admin/api",
    tags=["dashboard"],
    dependencies=[ApiAdmin],
    responses=documented(401, 403, 422),
)
Limit = Annotated[int, Query(ge=1, le=500, description="Items per page.")]
Reward = Annotated[float | None, Query(ge=-REWARD_BOUND, le=REWARD_BOUND)]


def iso_only(value: object) -> object:
    """Refuse a number where the document promises an ISO 8601 time (pydantic would read it as
    Unix seconds, any sign)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return value
        raise ValueError("give an ISO 8601 time, e.g. 2026-01-31T12:00:00Z")
    return value


Moment = Annotated[datetime | None, BeforeValidator(iso_only)]


@router.get("/runs", response_model=RunsPage, summary="Runs with their counts, newest first")
async def runs(ctx: Ctx, limit: Limit = 50, offset: Offset = 0) -> RunsPage:
    return await views.runs_page(ctx, limit, offset)


@router.get(
    "/runs/{run_id}",
    response_model=RunDetail,
    summary="A run, its counts and config",
    responses=documented(404),
)
async def run(run_id: PathId, ctx: Ctx) -> RunDetail:
    return await views.run_detail(ctx, run_id)


@router.get(
    "/runs/{run_id}/series",
    response_model=RunSeries,
    summary="A run's charts: trainer steps, rewards and sessions over time, weight swaps",
    responses=documented(404),
)
async def run_series(
    run_id: PathId,
    ctx: Ctx,
    after_step: Annotated[
        int,
        Query(ge=0, le=MAX_INT, description="Only steps after this one (poll with the last seen)."),
    ] = 0,
    max_points: Annotated[
        int, Query(ge=10, le=10_000, description="At most this many steps (every n-th).")
    ] = 2000,
) -> RunSeries:
    return await views.run_series(ctx, run_id, after_step, max_points)


@router.get("/sessions", response_model=SessionsPage, summary="Search sessions, newest first")
async def sessions(
    ctx: Ctx,
    run_id: QueryId = None,
    status: SessionStatus | None = None,
    task_id: QueryName = None,
    reward_min: Annotated[Reward, Query(description="Session reward at least.")] = None,
    reward_max: Annotated[Reward, Query(description="Session reward at most.")] = None,
    created_after: Annotated[Moment, Query(description="ISO 8601 time.")] = None,
    created_before: Annotated[Moment, Query(description="ISO 8601 time.")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> SessionsPage:
    where = SessionFilter(
        run_id, status, task_id, reward_min, reward_max, utc(created_after), utc(created_before)
    )
    return await views.sessions_page(ctx, where, limit, offset)


def utc(moment: datetime | None) -> datetime | None:
    """A time without a zone is taken as UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment


@router.get(
    "/sessions/{session_id}",
    response_model=SessionDetail,
    summary="A session as GET /rl/sessions/{id} shows it, with the token viewer's rows",
    responses=documented(404),
)
async def session(session_id: PathId, ctx: Ctx) -> SessionDetail:
    return await views.session_detail(ctx, session_id)


@router.get("/engines", response_model=list[EngineRow], summary="Engines: health, load, version")
async def engines(ctx: Ctx) -> list[EngineRow]:
    return await views.engine_rows(ctx)
