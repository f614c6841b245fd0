"""The trainer's claims as the REST API sees them: take sessions (grouped as the run says),
renew the lease, mark trained, drop sessions, confirm (with drops), release. The store does the
exactly-once part (``server.store.claims``); this module adds the run's config and wakes
admission."""

from __future__ import annotations

from datetime import timedelta

from server.context import ServerContext
from server.rl.runs import run_config
from server.rl.schemas import (
    ClaimedSessionOut,
    ClaimOut,
    ConfirmOut,
    DropOut,
    ReleaseOut,
    RenewOut,
    RowOut,
    TrainedOut,
)
from server.store import claims
from server.store.groups import GroupRule
from server.store.run_config import RunConfig
from server.store.tables import Run, utcnow


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
        # Built before the commit: a claim whose answer cannot be built is not taken.
        answer = ClaimOut(
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
    if result.dropped:
        await ctx.admission.notify()
    return answer


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
    async with ctx.sessionmaker() as db, db.begin():
        settlement = await claims.confirm(db, claim_id, dropped)
    if settlement.dropped:
        await ctx.admission.notify()
    return ConfirmOut(claim_id=claim_id, **vars(settlement))


async def mark_trained(ctx: ServerContext, claim_id: str, version: int) -> TrainedOut:
    """A step trained the claim and published ``version``: its sessions free their admission
    places, and admission waiters look again."""
    async with ctx.sessionmaker() as db, db.begin():
        marked = await claims.mark_trained(db, claim_id, version)
    if marked:
        await ctx.admission.notify()
    return TrainedOut(claim_id=claim_id, trained=marked)


async def drop(ctx: ServerContext, claim_id: str, dropped: dict[str, str]) -> DropOut:
    """Drop sessions of a claim now; admission waiters look again, as they no longer count."""
    async with ctx.sessionmaker() as db, db.begin():
        drops = await claims.drop(db, claim_id, dropped)
    if drops.dropped:
        await ctx.admission.notify()
    return DropOut(claim_id=claim_id, dropped=drops.dropped, held=drops.held)


async def release(ctx: ServerContext, claim_id: str) -> ReleaseOut:
    async with ctx.sessionmaker() as db, db.begin():
        released = await claims.release(db, claim_id)
    return ReleaseOut(claim_id=claim_id, released=released)
