"""Runs as the REST API sees them: create, show (with what of the sampled tokens trained, and
why the rest did not), configure (the validated config is kept in memory for a moment)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from server.common.trained_share import share_warning, untrained_warning
from server.context import ServerContext
from server.errors import InvalidConfig, RunNotFound
from server.rl import promotion
from server.rl.schemas import EvalFigures, RunEval, RunOut, RunTraining
from server.store import evaluation, run_versions, runs, stats, steps
from server.store.database import Db
from server.store.run_config import RunConfig
from server.store.tables import Run


def effective_config(run: Run) -> dict[str, Any]:
    """The run's config as it acts: every field, defaults included (for a run stored before a
    field existed), and the keys the server does not know."""
    return RunConfig.model_validate(run.config).model_dump()


async def run_view(ctx: ServerContext, run: Run) -> dict[str, Any]:
    async with ctx.sessionmaker() as db:
        counts = await runs.session_counts(db, run.id)
        totals = await runs.run_totals(db, run.id)
        eval_figures = await run_eval(db, run.id)
        gate = await promotion.view(db, run)
        training = await run_training(db, run)
        rollbacks = await run_versions.republished(db, run.id)
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
        eval=eval_figures,
        promotion=gate,
        training=training,
        rollbacks=rollbacks,
    ).model_dump()


async def run_training(db: Db, run: Run) -> RunTraining:
    """What of the run's sampled tokens trained: the totals of the trainer's latest step, the
    run's dropped sessions by reason code, and those dropped under the trainer's claims (for a
    run no step of which trained anything yet)."""
    latest = (await steps.latest_steps(db, [run.id])).get(run.id)
    dropped = (await stats.dropped_by_reason(db, [run.id]))[run.id]
    claimed = (await stats.dropped_by_reason(db, [run.id], claimed=True))[run.id]
    min_share = RunConfig.model_validate(run.config).min_trained_share
    metrics = latest.metrics if latest else None
    return training_view(metrics, dropped, min_share, claimed_dropped=claimed)


def training_view(
    metrics: dict[str, Any] | None,
    dropped: dict[str, int],
    min_share: float,
    claimed_dropped: Mapping[str, int] | None = None,
) -> RunTraining:
    """The trainer's totals from its latest step's ``metrics`` (null each without a step, from
    a trainer that does not report it, or mistyped), the run's ``dropped`` sessions by code, and
    a warning (``server.common.trained_share``): below ``min_share``, naming the trainer's
    masked tokens and dropped sessions; without a step, naming the sessions dropped under the
    trainer's claims (``claimed_dropped``): a batch that trains nothing is no step, so a run
    whose every batch was dropped has no totals."""
    # A step record holds whatever JSON the trainer sent: a mistyped total reads as null, never
    # as a 500 on every read of the run.
    got = (metrics or {}).get
    sampled, share = _count(got("total_sampled_tokens")), _share(got("total_trained_share"))
    masked, by_trainer = _counts(got("total_masked_tokens")), _counts(got("total_dropped_sessions"))
    if metrics is None:
        warning = untrained_warning(claimed_dropped or {})
    else:
        warning = share_warning(share, sampled, masked or {}, by_trainer or {}, min_share)
    return RunTraining(
        total_sampled_tokens=sampled,
        total_trained_tokens=_count(got("total_trained_tokens")),
        total_trained_share=share,
        total_masked_tokens=masked,
        total_dropped_sessions=by_trainer,
        dropped_sessions=dropped,
        min_trained_share=min_share,
        warning=warning,
    )


def _count(value: Any) -> int | None:
    """A count, or None for anything else (a bool, a fraction, a negative, a text)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _share(value: Any) -> float | None:
    """A finite share, or None for anything else."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _counts(value: Any) -> dict[str, int] | None:
    """Counts by name, or None unless every entry is one."""
    if not isinstance(value, dict):
        return None
    counts = {key: _count(n) for key, n in value.items()}
    if not all(isinstance(key, str) and n is not None for key, n in counts.items()):
        return None
    return {key: n for key, n in counts.items() if n is not None}


async def run_eval(db: Db, run_id: str) -> RunEval:
    """The run's eval sessions' rewards by version and task (``server.store.evaluation``)."""
    tasks, versions = evaluation.summarize(await evaluation.eval_scores(db, run_id))
    return RunEval(
        tasks=[EvalFigures(**vars(f)) for f in tasks],
        versions=[EvalFigures(**vars(f)) for f in versions],
    )


async def get_run(ctx: ServerContext, run_id: str) -> Run:
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
    if run is None:
        raise RunNotFound(run_id)
    return run


async def run_config(ctx: ServerContext, run_id: str) -> RunConfig:
    """The run's validated config (kept in memory for a moment: ``ctx.run_configs``)."""
    config = await ctx.run_configs.get(run_id)
    if config is None:
        raise RunNotFound(run_id)
    return config


async def create_run(ctx: ServerContext, name: str, config: RunConfig) -> tuple[Run, str]:
    async with ctx.sessionmaker() as db, db.begin():
        run, key = await runs.create_run(
            db, name, ctx.model_name, config.model_dump(exclude_none=False)
        )
        await promotion.configured(db, run, RunConfig(), config)
    ctx.run_configs.put(run.id, config)
    return run, key


async def update_config(ctx: ServerContext, run_id: str, patch: dict[str, Any]) -> Run:
    """Merge ``patch`` into the run's config; the result must validate as a RunConfig."""
    async with ctx.sessionmaker() as db, db.begin():
        run = await runs.get_run(db, run_id)
        if run is None:
            raise RunNotFound(run_id)
        merged = {**run.config, **patch}
        try:
            config = RunConfig.model_validate(merged)
        except ValueError as exc:
            raise InvalidConfig(str(exc)) from exc
        before = RunConfig.model_validate(run.config)
        run.config = config.model_dump()
        await promotion.configured(db, run, before, config)
    ctx.run_configs.put(run_id, config)
    ctx.run_adapters.forget(run_id)
    await ctx.admission.notify()
    return run
