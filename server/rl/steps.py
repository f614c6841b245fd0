"""Trainer steps as the REST API sees them: a trainer reports each step's figures, the
dashboard charts them.

What is stored is the trainer's figures, cleaned: non-finite numbers become null (JSON has no
NaN), and the batch's ``session_ids`` are replaced by the spread of those sessions' rewards
(``reward_std``, ``reward_min``, ``reward_max``, unless the trainer sent its own), so a step row
stays small whatever the batch size. This module knows nothing about charts.
"""

from __future__ import annotations

import math
from typing import Any

from server.context import ServerContext
from server.errors import RunNotFound
from server.rl.schemas import StepIn, StepOut
from server.store import rewards, runs, steps
from server.store.rewards import SESSION_TARGET

SESSION_IDS = "session_ids"
CHUNK = 1000  # ids per IN (...) query


def clean_value(value: Any) -> Any:
    """``value`` with non-finite numbers (also inside lists) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [clean_value(item) for item in value]
    return value


def reward_spread(values: list[float]) -> dict[str, float]:
    """Population standard deviation, min and max of ``values`` (empty: nothing)."""
    if not values:
        return {}
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    return {"reward_std": math.sqrt(variance), "reward_min": min(values), "reward_max": max(values)}


def session_reward(targets: dict[str, float]) -> float | None:
    """A session's reward: the whole-session reward, else the sum of its turn rewards."""
    if SESSION_TARGET in targets:
        return targets[SESSION_TARGET]
    return sum(targets.values()) if targets else None


async def record(ctx: ServerContext, run_id: str, body: StepIn) -> StepOut:
    """Store (or replace) the figures of one trainer step of ``run_id``."""
    metrics = {key: clean_value(value) for key, value in body.metrics.items()}
    session_ids = metrics.pop(SESSION_IDS, None)
    async with ctx.sessionmaker() as db, db.begin():
        if await runs.get_run(db, run_id) is None:
            raise RunNotFound(run_id)
        if isinstance(session_ids, list) and "reward_std" not in metrics:
            ids = [str(s) for s in session_ids if s is not None]
            values: list[float] = []
            for start in range(0, len(ids), CHUNK):
                by_session = await rewards.rewards_of(db, ids[start : start + CHUNK])
                values += [v for t in by_session.values() if (v := session_reward(t)) is not None]
            metrics.update(reward_spread(values))
        created = await steps.record_step(db, run_id, body.step, body.version, metrics)
    return StepOut(run_id=run_id, step=body.step, version=body.version, replaced=not created)
