"""The promotion gate: which version of a LoRA run its production sessions are served.

A run whose config has a ``promotion`` gate (``server.store.run_config.PromotionGate``) serves
its production sessions ``Run.promoted_version``: version 0 (the base) from the moment the gate
is configured, then each version the gate promotes. A version v newer than the promoted one is
promoted once its eval sessions (their scores by the version that answered them, as the run
view's eval figures count them: ``server.store.evaluation``) number at least
``min_eval_sessions`` and their mean reward is at least the promoted version's mean plus
``margin`` (the promoted version with no eval session: v needs only its count). Of several such
versions the newest is promoted. An evicted version is never promoted. An eval session counts
once it is rewarded, so the gate decides as each eval reward is recorded (``decide``, in that
reward's transaction), and when the gate is configured or changed.

``POST /rl/runs/{id}/promote`` promotes a version by hand (any version the run can still serve,
older ones included), with or without a gate; the gate, if any, goes on from there.

A gate needs a LoRA run: the engines serve one set of full weights, the current version's, so a
full-weight run cannot serve its production sessions another version. Configuring a gate on a
run that has published full weights is refused, and so is a full-weight publish to a run with a
promoted version. This module knows nothing of HTTP or of how a version is served
(``server.proxy`` reads ``Run.promoted_version`` through ``ctx.run_adapters``, kept a moment in
memory: once a promotion or a changed gate is committed, the run's entry there is forgotten, so
this replica serves it from the next request on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from server.context import ServerContext
from server.errors import PromotionRefused, RunNotFound, VersionEvicted, VersionNotFound
from server.rl.schemas import PromotionCandidate, PromotionOut
from server.store import evaluation, run_versions, runs
from server.store.database import Db
from server.store.run_config import PromotionGate, RunConfig
from server.store.tables import Run


@dataclass(frozen=True)
class Standing:
    """A version's eval figures: how many rewarded eval sessions it answered, their mean."""

    count: int
    mean: float


def promotable(
    promoted: int, standings: Mapping[int, Standing], gate: PromotionGate, servable: set[int]
) -> int | None:
    """The newest version above ``promoted``, among ``servable`` ones, whose ``standings``
    pass ``gate`` against the promoted version's; None when none does."""
    bar = standings.get(promoted)
    passing = [
        version
        for version, standing in standings.items()
        if version > promoted
        and version in servable
        and standing.count >= gate.min_eval_sessions
        and (bar is None or standing.mean >= bar.mean + gate.margin)
    ]
    return max(passing, default=None)


async def standings(db: Db, run_id: str) -> dict[int, Standing]:
    """The run's eval figures per version, over every task."""
    _, versions = evaluation.summarize(await evaluation.eval_scores(db, run_id))
    return {f.version: Standing(f.count, f.mean) for f in versions}


async def _servable(db: Db, run_id: str) -> set[int]:
    """The run's versions not evicted (0, the base, always)."""
    rows = await run_versions.listed(db, run_id)
    return {0, *(row.version for row in rows if row.evicted_at is None)}


async def decide(db: Db, run_id: str) -> int | None:
    """Promote what the run's gate now passes, if anything (a gated run's row locked meanwhile,
    so server processes sharing the store decide one at a time; a run without a gate is not
    locked, as most eval rewards are of such runs); the version promoted, or None (where a
    version is, the caller forgets the run's entry in ``ctx.run_adapters`` once committed)."""
    found = await runs.get_run(db, run_id)
    if found is None or RunConfig.model_validate(found.config).promotion is None:
        return None
    run = await runs.lock_run(db, run_id)  # read again under the lock
    gate = None if run is None else RunConfig.model_validate(run.config).promotion
    if run is None or gate is None or run.promoted_version is None:
        return None
    chosen = promotable(
        run.promoted_version, await standings(db, run_id), gate, await _servable(db, run_id)
    )
    if chosen is not None:
        await _promote(db, run, chosen)
    return chosen


async def _promote(db: Db, run: Run, version: int) -> None:
    run.promoted_version = version
    await run_versions.mark_promoted(db, run.id, version)


async def promote(ctx: ServerContext, run_id: str, version: int) -> Run:
    """Promote ``version`` by hand: one the run published (or 0, the base) and can still serve
    beside its current version."""
    async with ctx.sessionmaker() as db, db.begin():
        run = await runs.lock_run(db, run_id)
        if run is None:
            raise RunNotFound(run_id)
        if version != 0:
            row = await run_versions.get(db, run_id, version)
            if row is None:
                raise VersionNotFound(run_id, version)
            if row.evicted_at is not None:
                raise VersionEvicted(
                    f"Version {version} of run {run_id!r} was evicted ({row.evicted_reason}): "
                    "it cannot be served, so it cannot be promoted."
                )
        if full_weights(run) and version != run.policy_version:
            raise PromotionRefused(
                f"Run {run_id!r} trains full weights: its engines serve only its current version "
                f"({run.policy_version}), so version {version} cannot be served beside it. "
                "Promotion is for LoRA runs."
            )
        await _promote(db, run, version)
    ctx.run_adapters.forget(run_id)
    return run


def full_weights(run: Run) -> bool:
    """Has the run published full weights (the engines serve those, its current version's)?"""
    return not run.lora and run.policy_version > 0


async def configured(db: Db, run: Run, before: RunConfig, after: RunConfig) -> None:
    """The run's config changes from ``before`` to ``after`` (in ``db``'s transaction): a gate
    configured starts at version 0 (or the version promoted by hand) and decides at once; a
    gate removed leaves the run with no promoted version. Refused for a full-weight run. The
    caller forgets the run's entry in ``ctx.run_adapters`` once committed."""
    if after.promotion is None:
        if before.promotion is not None:
            run.promoted_version = None
        return
    if full_weights(run):
        raise PromotionRefused(
            f"Run {run.id!r} has published full weights (version {run.policy_version}): its "
            "engines serve only its current version, so its production sessions cannot be "
            "served another. A promotion gate needs a LoRA run.",
            param="promotion",
        )
    if run.promoted_version is None:
        run.promoted_version = 0
    await db.flush()
    await decide(db, run.id)


async def refuse_full_weights(ctx: ServerContext, run_id: str) -> None:
    """``PromotionRefused`` for a full-weight publish to a run with a promoted version: the
    engines would stop serving it to the run's production sessions."""
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
    if run is not None and run.promoted_version is not None:
        raise PromotionRefused(
            f"Run {run_id!r} serves its production sessions version {run.promoted_version} "
            "(its promotion gate, or a promotion by hand), and full weights would replace it on "
            "every engine: nothing was swapped. Promotion is for LoRA runs; remove the gate "
            '(PATCH config {"promotion": null}) to publish full weights.',
            param="model_path",
        )


async def view(db: Db, run: Run) -> PromotionOut | None:
    """What the run view shows of its gate: the promoted version, the newer versions that are
    candidates (published, not evicted), each with its eval count and mean, and the rule's
    figures; None for a run with no promoted version."""
    if run.promoted_version is None:
        return None
    gate = RunConfig.model_validate(run.config).promotion
    figures = await standings(db, run.id)
    servable = await _servable(db, run.id)
    promoted = figures.get(run.promoted_version)
    return PromotionOut(
        promoted_version=run.promoted_version,
        promoted_count=promoted.count if promoted else 0,
        promoted_mean=promoted.mean if promoted else None,
        margin=gate.margin if gate else None,
        min_eval_sessions=gate.min_eval_sessions if gate else None,
        candidates=[
            PromotionCandidate(
                version=v,
                count=figures[v].count if v in figures else 0,
                mean=figures[v].mean if v in figures else None,
            )
            for v in sorted(servable)
            if v > run.promoted_version
        ],
    )
