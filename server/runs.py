"""Runs as the REST API sees them: create, show, configure, and claims for the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.context import ServerContext
from server.errors import NotFound, Unprocessable
from server.run_config import RunConfig
from server.schemas import ClaimedSessionOut, ClaimOut, RowOut, RunOut
from server.store import claims, runs
from server.store.tables import Run


async def run_view(ctx: ServerContext, run: Run) -> dict[str, Any]:
    async with ctx.sessionmaker() as db:
        counts = await runs.session_counts(db, run.id)
        totals = await runs.run_totals(db, run.id)
    return RunOut(
        id=run.id,
        name=run.name,
        model=run.model,
        model_path=str(Path(ctx.settings.model).resolve()),
        weights_path=run.weights_path,
        config=run.config,
        policy_version=run.policy_version,
        is_default=run.is_default,
        created_at=run.created_at,
        sessions=counts,
        totals=totals,
    ).model_dump()


async def get_run(ctx: ServerContext, run_id: str) -> Run:
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
    if run is None:
        raise NotFound(f"No run {run_id!r}.", code="run_not_found")
    return run


async def create_run(ctx: ServerContext, name: str, config: RunConfig) -> tuple[Run, str]:
    async with ctx.sessionmaker() as db, db.begin():
        return await runs.create_run(
            db, name, ctx.model_name, config.model_dump(exclude_none=False)
        )


async def update_config(ctx: ServerContext, run_id: str, patch: dict[str, Any]) -> Run:
    """Merge ``patch`` into the run's config; the result must validate as a RunConfig."""
    async with ctx.sessionmaker() as db, db.begin():
        run = await runs.get_run(db, run_id)
        if run is None:
            raise NotFound(f"No run {run_id!r}.", code="run_not_found")
        merged = {**run.config, **patch}
        try:
            config = RunConfig.model_validate(merged)
        except ValueError as exc:
            raise Unprocessable(f"Invalid run config: {exc}") from exc
        run.config = config.model_dump()
    await ctx.admission.notify()
    return run


async def claim(
    ctx: ServerContext, run: Run, max_sessions: int, lease_s: float | None, group: int | None
) -> ClaimOut:
    config = RunConfig.model_validate(run.config)
    async with ctx.sessionmaker() as db, db.begin():
        result = await claims.claim(
            db,
            run.id,
            max_sessions,
            lease_s or config.claim_lease_s,
            group if group is not None else config.group_size,
        )
    return ClaimOut(
        claim_id=result.claim_id,
        expires_at=result.expires_at,
        sessions=[
            ClaimedSessionOut(
                session_id=s.session_id,
                task_id=s.task_id,
                group_id=s.group_id,
                metadata=s.metadata,
                reward=s.reward,
                rows=[RowOut(**vars(row)) for row in s.rows],
            )
            for s in result.sessions
        ],
    )


async def finish_claim(ctx: ServerContext, claim_id: str, consumed: bool) -> int:
    async with ctx.sessionmaker() as db, db.begin():
        if consumed:
            return await claims.confirm(db, claim_id)
        return await claims.release(db, claim_id)
