"""Runs as the REST API sees them: create, show, configure (the validated config is kept in
memory for a moment), and the trainer's claims: take, renew, drop sessions, confirm (with
drops), release."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
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
    DropOut,
    ReleaseOut,
    RenewOut,
    RowOut,
    RunOut,
)
from server.store import claims, runs
from server.store.groups import GroupRule
from server.store.tables import Run, utcnow

# How long a run's config is kept in memory: another server process on the same store sees a
# PATCH within this (every request needs the run's temperature; a read per request would cost).
RUN_CONFIG_TTL_S = 2.0


def effective_config(run: Run) -> dict[str, Any]:
    """The run's config as it acts: every field, defaults included (for a run stored before a
    field existed), and the keys the server does not know."""
    return RunConfig.model_validate(run.config).model_dump()


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
        config=effective_config(run),
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
    """The run's validated config, read from the store at most every RUN_CONFIG_TTL_S seconds
    and kept in memory meanwhile; create_run and update_config replace it at once."""
    cached = ctx.run_configs.get(run_id)
    if cached is not None and time.monotonic() - cached[0] < RUN_CONFIG_TTL_S:
        return cached[1]
    read_at = time.monotonic()
    config = RunConfig.model_validate((await get_run(ctx, run_id)).config)
    ctx.run_configs[run_id] = (read_at, config)
    return config


async def create_run(ctx: ServerContext, name: str, config: RunConfig) -> tuple[Run, str]:
    async with ctx.sessionmaker() as db, db.begin():
        run, key = await runs.create_run(
            db, name, ctx.model_name, config.model_dump(exclude_none=False)
        )
    ctx.run_configs[run.id] = (time.monotonic(), config)
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
    ctx.run_configs[run_id] = (time.monotonic(), config)
    await ctx.admission.notify()
    return run


# ----- claims ----------------------------------------------------------------------------------


def group_rule(config: RunConfig, group_size: int | None) -> GroupRule:
    """How a claim groups sessions: by the claim's group_size, else the run's (none: 1, which
    still keeps group_id groups whole)."""
    size = group_size if group_size is not None else config.group_size
    return GroupRule(size or 1, config.group_timeout_s, config.on_incomplete_group)


async def claim(
    ctx: ServerContext, run: Run, max_sessions: int, lease_s: float | None, group: int | None
) -> ClaimOut:
    """Claim sessions of ``run`` (as just read from the store: its config is the freshest)."""
    config = RunConfig.model_validate(run.config)
    rule = group_rule(config, group)
    async with ctx.sessionmaker() as db, db.begin():
        result = await claims.claim(db, run.id, max_sessions, lease_s or config.claim_lease_s, rule)
    if result.dropped:
        await ctx.admission.notify()
    return ClaimOut(
        claim_id=result.claim_id,
        expires_at=result.expires_at,
        run_config=config.model_dump(),
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


@contextlib.asynccontextmanager
async def _named_in(claim_id: str) -> AsyncIterator[None]:
    """Sessions named in ``dropped`` that are not the claim's: a 422 naming them."""
    try:
        yield
    except claims.NotInClaim as exc:
        raise Unprocessable(
            f"Sessions named in dropped are not in claim {claim_id!r}: "
            f"{', '.join(exc.session_ids[:20])}.",
            param="dropped",
            code="not_in_claim",
        ) from exc


async def confirm(ctx: ServerContext, claim_id: str, dropped: dict[str, str]) -> ConfirmOut:
    async with _named_in(claim_id), ctx.sessionmaker() as db, db.begin():
        settlement = await claims.confirm(db, claim_id, dropped)
    if settlement.dropped:
        await ctx.admission.notify()
    return ConfirmOut(claim_id=claim_id, **vars(settlement))


async def drop(ctx: ServerContext, claim_id: str, dropped: dict[str, str]) -> DropOut:
    """Drop sessions of a claim now; admission waiters look again, as they no longer count."""
    async with _named_in(claim_id), ctx.sessionmaker() as db, db.begin():
        drops = await claims.drop(db, claim_id, dropped)
    if drops.dropped:
        await ctx.admission.notify()
    return DropOut(claim_id=claim_id, dropped=drops.dropped, held=drops.held)


async def release(ctx: ServerContext, claim_id: str) -> ReleaseOut:
    async with ctx.sessionmaker() as db, db.begin():
        released = await claims.release(db, claim_id)
    return ReleaseOut(claim_id=claim_id, released=released)
