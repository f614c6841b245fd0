"""Runs as the REST API sees them: create, show (with what of the sampled tokens trained, and
why the rest did not), configure (the validated config is kept in memory for a moment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.context import ServerContext
from server.errors import InvalidConfig, RunNotFound
from server.rl.schemas import EvalFigures, RunEval, RunOut, RunTraining
from server.store import evaluation, runs, stats, steps
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
        training = await run_training(db, run)
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
        training=training,
    ).model_dump()


TOTALS = (
    "total_sampled_tokens",
    "total_trained_tokens",
    "total_trained_share",
    "total_masked_tokens",
    "total_dropped_sessions",
)


async def run_training(db: Db, run: Run) -> RunTraining:
    """What of the run's sampled tokens trained: the totals of the trainer's latest step, and
    the run's dropped sessions by reason code."""
    latest = (await steps.latest_steps(db, [run.id])).get(run.id)
    dropped = (await stats.dropped_by_reason(db, [run.id]))[run.id]
    min_share = RunConfig.model_validate(run.config).min_trained_share
    return training_view(latest.metrics if latest else None, dropped, min_share)


def training_view(
    metrics: dict[str, Any] | None, dropped: dict[str, int], min_share: float
) -> RunTraining:
    """The trainer's totals from its latest step's ``metrics`` (null each without a step, or
    from a trainer that does not report it), the drops, and a warning when the trained share
    is below ``min_share``, naming the biggest causes."""
    totals = {key: (metrics or {}).get(key) for key in TOTALS}
    share = totals["total_trained_share"]
    warning = None
    if isinstance(share, int | float) and share < min_share:
        masked = totals["total_masked_tokens"] or {}
        causes = [f"{n} tokens masked as {cause}" for cause, n in _biggest(masked)]
        causes += [f"{n} sessions dropped as {code}" for code, n in _biggest(dropped)]
        warning = (
            f"Only {share:.0%} of the {totals['total_sampled_tokens']} tokens the trainer's "
            f"sessions sampled trained, below min_trained_share ({min_share:g}). The biggest "
            f"causes: {'; '.join(causes) or 'none counted'}."
        )
    return RunTraining(
        **totals, dropped_sessions=dropped, min_trained_share=min_share, warning=warning
    )


def _biggest(counts: dict[str, int], top: int = 3) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda item: -item[1])[:top]


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
        run.config = config.model_dump()
    ctx.run_configs.put(run_id, config)
    await ctx.admission.notify()
    return run
