"""Evaluation sessions' scores, by the policy version that answered and by task.

An eval session counts once it has a reward: its session reward, else the mean of its turn
rewards (every turn's, alternatives included). It counts under the policy version of its first
sampled token: the first completion token of its first turn that sampled any (the weights that
answered; a session whose turns sampled nothing counts nowhere). Figures per (version, task) and
per version over all tasks: count, mean, population std (ddof 0), min, max.

The read fetches one row per reward and the first four bytes of each eval turn's versions, never
a whole turn; the summary is pure. This module knows nothing about HTTP or training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.store.packing import unpack_ints
from server.store.tables import SESSION_TARGET, Reward, Session, Turn

VERSION_BYTES = 4  # one int32 (server.store.packing)


@dataclass(frozen=True)
class Score:
    """One rewarded eval session: the version that answered, its task, its reward."""

    version: int
    task_id: str | None
    reward: float


@dataclass(frozen=True)
class Figures:
    """Rewards of a set of eval sessions."""

    version: int
    task_id: str | None  # None: no task, or (in per-version totals) every task
    count: int
    mean: float
    std: float
    min: float
    max: float


def session_score(rewards: dict[str, float]) -> float | None:
    """An eval session's score from its rewards by target: the session reward, else the mean of
    its turn rewards, else none."""
    if SESSION_TARGET in rewards:
        return rewards[SESSION_TARGET]
    if not rewards:
        return None
    return math.fsum(rewards.values()) / len(rewards)


def figures(version: int, task_id: str | None, rewards: list[float]) -> Figures:
    mean = math.fsum(rewards) / len(rewards)
    variance = math.fsum((r - mean) ** 2 for r in rewards) / len(rewards)
    return Figures(
        version, task_id, len(rewards), mean, math.sqrt(variance), min(rewards), max(rewards)
    )


def summarize(scores: Iterable[Score]) -> tuple[list[Figures], list[Figures]]:
    """Per (version, task) and per version over all tasks, in version order (tasks by name,
    no task first)."""
    by_task: dict[tuple[int, str | None], list[float]] = {}
    by_version: dict[int, list[float]] = {}
    for score in scores:
        by_task.setdefault((score.version, score.task_id), []).append(score.reward)
        by_version.setdefault(score.version, []).append(score.reward)
    tasks = sorted(by_task, key=lambda key: (key[0], key[1] is not None, key[1] or ""))
    return (
        [figures(version, task, by_task[version, task]) for version, task in tasks],
        [figures(version, None, by_version[version]) for version in sorted(by_version)],
    )


async def eval_scores(db: AsyncSession, run_id: str) -> list[Score]:
    """The run's rewarded eval sessions that sampled a token, each with its version."""
    rewarded = await db.execute(
        select(Session.id, Session.task_id, Reward.target, Reward.value)
        .join(Reward, Reward.session_id == Session.id)
        .where(Session.run_id == run_id, Session.eval.is_(True))
    )
    tasks: dict[str, str | None] = {}
    rewards: dict[str, dict[str, float]] = {}
    for session_id, task_id, target, value in rewarded.all():
        tasks[session_id] = task_id
        rewards.setdefault(session_id, {})[target] = float(value)
    if not rewards:
        return []
    first_versions = await db.execute(
        select(Turn.session_id, func.substr(Turn.versions, 1, VERSION_BYTES))
        .join(Session, Session.id == Turn.session_id)
        .where(Session.run_id == run_id, Session.eval.is_(True), Turn.completion_tokens > 0)
        .order_by(Turn.session_id, Turn.turn_index)
    )
    versions: dict[str, int] = {}
    for session_id, head in first_versions.all():
        if session_id not in versions and head:
            versions[session_id] = unpack_ints(bytes(head))[0]
    scores = []
    for session_id, targets in rewards.items():
        score = session_score(targets)
        if score is not None and session_id in versions:
            scores.append(Score(versions[session_id], tasks[session_id], score))
    return scores
