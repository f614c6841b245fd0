"""What the dashboard shows, as data: runs with their counts, a run's time series, a page of
sessions, one session with its token rows, the engines.

The JSON API returns these as they are and the HTML pages render them, so both always agree.
Every read is aggregated or paginated (``server.store.stats``); this module knows nothing
about HTML.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime
from typing import Any

from server.context import ServerContext
from server.dashboard.schemas import (
    EngineRow,
    RewardPoint,
    RunDetail,
    RunSeries,
    RunsPage,
    RunSummary,
    SessionDetail,
    SessionPoint,
    SessionRow,
    SessionsPage,
    StepPoint,
    SwapPoint,
)
from server.dashboard.tokens import token_rows
from server.engine_client.pool import EngineState
from server.rl import runs as run_views
from server.rl import sessions as session_views
from server.store import runs, stats, steps
from server.store.run_config import RunConfig
from server.store.tables import Run, TrainerStep

NICE_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200)
DAY = 86400
TARGET_BUCKETS = 120
ACTIVE_AFTER_S = 300.0  # a trainer is idle after this long without a step, at the least
QUIET_AFTER_S = 30.0  # and quiet after three step intervals without one, this long at the least
LOAD_TIMEOUT_S = 2.0


def bucket_width(span_seconds: float, target: int = TARGET_BUCKETS) -> int:
    """The smallest nice width (seconds) that cuts ``span_seconds`` into at most ``target``
    buckets."""
    for width in NICE_WIDTHS:
        if span_seconds / width <= target:
            return width
    return DAY * max(1, math.ceil(span_seconds / DAY / target))


def trainer_active(span: stats.StepSpan | None, now: datetime) -> bool:
    """Did a step arrive within three mean step intervals (five minutes at the least)?"""
    if span is None:
        return False
    return (now - span.last_at).total_seconds() < max(ACTIVE_AFTER_S, 3 * _interval(span))


def trainer_status(
    span: stats.StepSpan | None, last: TrainerStep | None, now: datetime
) -> tuple[str, datetime | None]:
    """What the trainer is doing, and since when no word came from it if it has gone quiet.

    "stopped" as soon as it says so (a trainer that stops cleanly reposts its last step with
    ``stopped_at``); "training" while steps come, still "training" but quiet after three step
    intervals without one (30 s at the least: it may be slow, stuck or killed), "idle" once
    ``trainer_active`` says so; "not started" before any step."""
    if span is None or last is None:
        return "not started", None
    if last.metrics.get("stopped_at") is not None:
        return "stopped", None
    silent_s = (now - span.last_at).total_seconds()
    quiet = silent_s > max(QUIET_AFTER_S, 3 * _interval(span))
    return ("training" if trainer_active(span, now) else "idle"), span.last_at if quiet else None


def _interval(span: stats.StepSpan) -> float:
    """The mean seconds between the run's steps."""
    return (span.last_at - span.first_at).total_seconds() / max(span.count - 1, 1)


# ----- runs ------------------------------------------------------------------------------------


async def _summaries(ctx: ServerContext, found: list[Run]) -> list[dict[str, Any]]:
    ids = [run.id for run in found]
    async with ctx.sessionmaker() as db:
        counts = await stats.session_counts(db, ids)
        rewards = await stats.reward_means(db, ids)
        spans = await stats.step_spans(db, ids)
        latest = await steps.latest_steps(db, ids)
        dropped = await stats.dropped_by_reason(db, ids)
        claimed_dropped = await stats.dropped_by_reason(db, ids, claimed=True)
    now = datetime.now(UTC)
    out = []
    for run in found:
        mean, rewarded = rewards.get(run.id, (None, 0))
        last = latest.get(run.id)
        span = spans.get(run.id)
        trainer, quiet_since = trainer_status(span, last, now)
        out.append(
            {
                "id": run.id,
                "name": run.name,
                "model": run.model,
                "is_default": run.is_default,
                "created_at": run.created_at,
                "policy_version": run.policy_version,
                "sessions": counts[run.id],
                "session_total": sum(counts[run.id].values()),
                "reward_mean": mean,
                "rewarded_sessions": rewarded,
                "steps": span.count if span else 0,
                "last_step": last.step if last else None,
                "last_step_at": last.created_at if last else None,
                "trainer_active": trainer == "training",
                "trainer": trainer,
                "trainer_quiet_since": quiet_since,
                "training": run_views.training_view(
                    last.metrics if last else None,
                    dropped[run.id],
                    RunConfig.model_validate(run.config).min_trained_share,
                    claimed_dropped=claimed_dropped[run.id],
                ),
            }
        )
    return out


async def runs_page(ctx: ServerContext, limit: int, offset: int) -> RunsPage:
    async with ctx.sessionmaker() as db:
        found = await runs.list_runs(db, limit, offset)
        total = await runs.run_count(db)
    items = [RunSummary(**summary) for summary in await _summaries(ctx, found)]
    return RunsPage(items=items, total=total, limit=limit, offset=offset)


async def run_detail(ctx: ServerContext, run_id: str) -> RunDetail:
    run = await run_views.get_run(ctx, run_id)
    (summary,) = await _summaries(ctx, [run])
    async with ctx.sessionmaker() as db:
        totals = await runs.run_totals(db, run.id)
    return RunDetail(**summary, config=run_views.effective_config(run), totals=totals)


def _step_point(step: TrainerStep) -> StepPoint:
    moment = step.metrics.get("time")
    if not isinstance(moment, int | float):
        moment = step.created_at.timestamp()
    return StepPoint(step=step.step, version=step.version, time=moment, metrics=step.metrics)


async def run_series(
    ctx: ServerContext, run_id: str, after_step: int, max_points: int
) -> RunSeries:
    """The run's charts: trainer steps after ``after_step``, rewards and sessions over time,
    weight swaps."""
    run = await run_views.get_run(ctx, run_id)
    async with ctx.sessionmaker() as db:
        found = await steps.steps_after(db, run.id, after_step, max_points)
        count = await steps.step_count(db, run.id)
        span = await stats.session_time_span(db, run.id)
        width = bucket_width(time.time() - span[0] if span else 0.0)
        rewards = await stats.reward_buckets(db, run.id, width) if span else []
        sessions = await stats.session_buckets(db, run.id, width) if span else {}
        eval_figures = await run_views.run_eval(db, run.id)
    swaps = [swap for swap in ctx.pool.swaps if swap.get("run_id") == run.id]
    return RunSeries(
        run_id=run.id,
        policy_version=run.policy_version,
        now=time.time(),
        steps=[_step_point(step) for step in found],
        step_count=count,
        min_trained_share=RunConfig.model_validate(run.config).min_trained_share,
        bucket_seconds=width,
        rewards=[
            RewardPoint(
                time=b.bucket * width,
                count=b.count,
                mean=b.mean,
                std=math.sqrt(max(b.mean_square - b.mean * b.mean, 0.0)),
                min=b.low,
                max=b.high,
            )
            for b in rewards
        ],
        sessions=[
            SessionPoint(time=bucket * width, **row) for bucket, row in sorted(sessions.items())
        ],
        swaps=[
            SwapPoint(version=s["version"], pause_seconds=s["pause_seconds"], time=s["at"])
            for s in swaps
        ],
        eval=eval_figures,
    )


# ----- sessions --------------------------------------------------------------------------------


async def sessions_page(
    ctx: ServerContext, where: stats.SessionFilter, limit: int, offset: int
) -> SessionsPage:
    async with ctx.sessionmaker() as db:
        total, found = await stats.search_sessions(db, where, limit, offset)
        tokens = await stats.completion_tokens(db, [s.id for s, _ in found]) if found else {}
    items = [
        SessionRow(
            **session_views.summary_fields(s),
            reward=reward,
            completion_tokens=tokens.get(s.id, 0),
        )
        for s, reward in found
    ]
    return SessionsPage(items=items, total=total, limit=limit, offset=offset)


async def session_detail(ctx: ServerContext, session_id: str) -> SessionDetail:
    """The session as GET /rl/sessions/{id} shows it, plus its token rows with texts."""
    session = await session_views.get_session(ctx, session_id)
    view = await session_views.session_view(ctx, session)
    rows = token_rows(view.rows, ctx.tokenizer.token_text)
    return SessionDetail(**view.model_dump(), token_rows=rows)


# ----- engines ---------------------------------------------------------------------------------


def _load_figures(
    answer: dict[str, Any] | BaseException,
) -> tuple[int | None, int | None, float | None]:
    if isinstance(answer, BaseException):
        return None, None, None
    loads = answer.get("loads") or []
    running = sum(int(entry.get("num_running_reqs", 0)) for entry in loads)
    queued = sum(int(entry.get("num_waiting_reqs", 0)) for entry in loads)
    throughput = sum(float(entry.get("gen_throughput") or 0.0) for entry in loads)
    return running, queued, throughput


async def _loads(engine: EngineState) -> dict[str, Any]:
    return await asyncio.wait_for(engine.client.loads(), LOAD_TIMEOUT_S)


async def engine_rows(ctx: ServerContext) -> list[EngineRow]:
    """Each engine as the pool sees it, with the engine's own load (asked now, briefly)."""
    engines = ctx.pool.engines
    answers = await asyncio.gather(*(_loads(e) for e in engines), return_exceptions=True)
    rows = []
    for engine, answer in zip(engines, answers, strict=True):
        running, queued, throughput = _load_figures(answer)
        rows.append(
            EngineRow(
                url=engine.url,
                healthy=engine.healthy,
                in_flight=engine.in_flight,
                running=running,
                queued=queued,
                weight_version=engine.weight_version,
                served_tokens=engine.served_tokens,
                tokens_per_second=engine.tokens_per_second,
                engine_tokens_per_second=throughput,
                failures=engine.failures,
                last_error=engine.last_error,
            )
        )
    return rows
