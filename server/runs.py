"""Runs as the REST API sees them: create, show, configure (the validated config is kept in
memory), and the trainer's claims: take, renew, confirm (with drops), release."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from server.context import ServerContext
from server.errors import NotFound, Unprocessable
from server.run_config import RunConfig
from server.schemas import (
    ClaimedSessionOut,
    ClaimOut,
    ConfirmOut,
    ReleaseOut,
    RenewOut,
    RowOut,
    RunOut,
)
from server.store import claims, runs
from server.store.groups import GroupRule
from server.store.tables import Run, utcnow


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


async def run_config(ctx: ServerContext, run_id: str) -> RunConfig:
    """The run's validated config, read from the store once and then kept in memory (every
    request needs its temperature); create_run and update_config replace it."""
    config = ctx.run_configs.get(run_id)
    if config is None:
        run = await get_run(ctx, run_id)
        config = ctx.run_configs[run_id] = RunConfig.model_validate(run.config)
    return config


async def create_run(ctx: ServerContext, name: str, config: RunConfig) -> tuple[Run, str]:
    async with ctx.sessionmaker() as db, db.begin():
        run, key = await runs.create_run(
            db, name, ctx.model_name, config.model_dump(exclude_none=False)
        )
    ctx.run_configs[run.id] = config
    return run, key


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
    ctx.run_configs[run_id] = config
    await ctx.admission.notify()
    return run


# ----- claims ----------------------------------------------------------------------------------


def group_rule(config: RunConfig, group_size: int | None) -> GroupRule | None:
    """How a claim groups sessions: the claim's group_size, else the run's (None: no groups)."""
    size = group_size if group_size is not None else config.group_size
    if size is None or size <= 1:
        return None
    return GroupRule(size, config.group_timeout_s, config.on_incomplete_group)


async def claim(
    ctx: ServerContext, run: Run, max_sessions: int, lease_s: float | None, group: int | None
) -> ClaimOut:
    config = await run_config(ctx, run.id)
    rule = group_rule(config, group)
    async with ctx.sessionmaker() as db, db.begin():
        result = await claims.claim(db, run.id, max_sessions, lease_s or config.claim_lease_s, rule)
    if result.dropped:
        await ctx.admission.notify()
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


async def renew(ctx: ServerContext, claim_ids: list[str], lease_s: float | None) -> RenewOut:
    """Hold the claims longer: ``lease_s``, else the shortest claim_lease_s of their runs."""
    if lease_s is None:
        async with ctx.sessionmaker() as db:
            run_ids = await claims.runs_of(db, claim_ids)
        leases = [(await run_config(ctx, run_id)).claim_lease_s for run_id in run_ids]
        lease_s = min(leases, default=None)
    if lease_s is None:  # no claim holds a session: nothing to renew
        return RenewOut(held=dict.fromkeys(claim_ids, 0), expires_at=None)
    expires = utcnow() + timedelta(seconds=lease_s)
    async with ctx.sessionmaker() as db, db.begin():
        held = await claims.renew(db, claim_ids, expires)
    return RenewOut(held=held, expires_at=expires if any(held.values()) else None)


async def confirm(ctx: ServerContext, claim_id: str, dropped: dict[str, str]) -> ConfirmOut:
    try:
        async with ctx.sessionmaker() as db, db.begin():
            settlement = await claims.confirm(db, claim_id, dropped)
    except claims.NotInClaim as exc:
        raise Unprocessable(
            f"Sessions named in dropped are not in claim {claim_id!r}: "
            f"{', '.join(exc.session_ids[:20])}.",
            param="dropped",
            code="not_in_claim",
        ) from exc
    if settlement.dropped:
        await ctx.admission.notify()
    return ConfirmOut(claim_id=claim_id, **vars(settlement))


async def release(ctx: ServerContext, claim_id: str) -> ReleaseOut:
    async with ctx.sessionmaker() as db, db.begin():
        released = await claims.release(db, claim_id)
    return ReleaseOut(claim_id=claim_id, released=released)
