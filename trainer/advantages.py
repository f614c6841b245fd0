"""Rewards to per-turn advantages: discounted returns, group baselines, a running baseline.

A session is a list of turns. A turn may carry its own reward and the session may carry a
session reward; `turn_returns` folds them into a discounted return G_t per turn. One score
per session (its G_0) feeds the estimator, which turns into a shift (and for GRPO-style
estimators a scale) that is applied to every G_t of the session:

    grpo          (G_t - mean) / (std + eps)      over the session's group
    dr_grpo       G_t - mean                       over the session's group
    rloo          G_t - mean of the *other* sessions of the group
    reinforce_pp  (G_t - mean) / (std + eps)      over the whole batch
    running       G_t - running baseline of the session's task

Groups are formed by ``group_key``, else ``task_key`` (a group key and a task key never share
a group, even if they are spelled the same). A group of one session has nothing to compare
with, so all its advantages are 0; so has a group (or, under reinforce_pp, a batch) whose
scores are all equal, because dividing per-turn differences by a zero spread would blow up.
Sessions with neither key are treated as under ``running`` with the key ``""`` when a
`RunningBaseline` is given, and get advantage 0 otherwise.

This module knows nothing about tokens, storage or torch: it maps floats to floats. Spreading a
turn's advantage over that turn's tokens is the caller's job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "running"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "running")
NO_KEY = ""  # the running-baseline key of sessions without task (and group) key


def turn_returns(
    turn_rewards: Sequence[float | None], session_reward: float | None, discount: float
) -> list[float]:
    """Discounted return per turn: G_t = r_t + discount * G_{t+1}.

    r_t is the turn's own reward (None counts as 0); the session reward is added to the last
    turn's reward. A session without turns has no returns.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    rewards = [0.0 if r is None else float(r) for r in turn_rewards]
    if rewards and session_reward is not None:
        rewards[-1] += float(session_reward)
    returns = [0.0] * len(rewards)
    following = 0.0
    for t in reversed(range(len(rewards))):
        following = rewards[t] + discount * following
        returns[t] = following
    return returns


# --- estimators on one list of scores -------------------------------------------------------


@dataclass(frozen=True)
class _Shift:
    """Turns a return into an advantage: (value - baseline) / scale.

    Where a session gets ``None`` instead of a shift, it has no signal: every advantage is 0.
    """

    baseline: float
    scale: float = 1.0

    def __call__(self, value: float) -> float:
        return (value - self.baseline) / self.scale


def _mean(scores: Sequence[float]) -> float:
    return math.fsum(scores) / len(scores)


def _std(scores: Sequence[float]) -> float:
    """Population standard deviation."""
    mean = _mean(scores)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in scores) / len(scores))


def _no_contrast(scores: Sequence[float]) -> bool:
    return len(scores) < 2 or max(scores) == min(scores)


def _normalised_shifts(scores: Sequence[float], eps: float) -> list[_Shift | None]:
    if _no_contrast(scores):
        return [None] * len(scores)
    shift = _Shift(_mean(scores), _std(scores) + eps)
    return [shift] * len(scores)


def _centred_shifts(scores: Sequence[float]) -> list[_Shift | None]:
    if len(scores) < 2:
        return [None] * len(scores)
    return [_Shift(_mean(scores))] * len(scores)


def _leave_one_out_shifts(scores: Sequence[float]) -> list[_Shift | None]:
    if len(scores) < 2:
        return [None] * len(scores)
    total = math.fsum(scores)
    return [_Shift((total - x) / (len(scores) - 1)) for x in scores]


def _apply(shifts: Sequence[_Shift | None], values: Sequence[float]) -> list[float]:
    return [0.0 if shift is None else shift(x) for shift, x in zip(shifts, values, strict=True)]


def grpo(scores: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(x - mean) / (population std + eps) within one group; 0 for a group without contrast."""
    return _apply(_normalised_shifts(scores, eps), scores)


def dr_grpo(scores: Sequence[float]) -> list[float]:
    """x - mean within one group (Dr. GRPO: no std scaling); 0 for a group of one."""
    return _apply(_centred_shifts(scores), scores)


def rloo(scores: Sequence[float]) -> list[float]:
    """x minus the mean of the other sessions of the group; 0 for a group of one."""
    return _apply(_leave_one_out_shifts(scores), scores)


def reinforce_pp(scores: Sequence[float], eps: float = 1e-6) -> list[float]:
    """REINFORCE++: (x - mean) / (std + eps) over the whole batch (scores are the batch)."""
    return _apply(_normalised_shifts(scores, eps), scores)


# --- running baseline -----------------------------------------------------------------------


class RunningBaseline:
    """Per-key exponential moving average of session scores.

    The first score of a key becomes its value; later ones move it by ``1 - momentum``. The
    state is a plain ``{key: value}`` dict of floats, so the trainer can checkpoint it as JSON.
    """

    def __init__(self, momentum: float) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self._values: dict[str, float] = {}

    def value(self, key: str) -> float | None:
        return self._values.get(key)

    def update(self, key: str, score: float) -> None:
        old = self._values.get(key)
        score = float(score)
        self._values[key] = (
            score if old is None else self.momentum * old + (1 - self.momentum) * score
        )

    def state_dict(self) -> dict[str, float]:
        return dict(self._values)

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self._values = {str(key): float(value) for key, value in state.items()}


# --- per-session, per-turn advantages ---------------------------------------------------------


@dataclass(frozen=True)
class SessionReturns:
    """One session's grouping keys and its per-turn returns (from `turn_returns`)."""

    group_key: str | None
    task_key: str | None
    returns: list[float]

    @property
    def score(self) -> float:
        return self.returns[0]


def _group_of(session: SessionReturns) -> tuple[str, str] | None:
    if session.group_key is not None:
        return ("group", session.group_key)
    if session.task_key is not None:
        return ("task", session.task_key)
    return None


def _running_key(session: SessionReturns) -> str:
    """Groups are one-off, so the running baseline is kept per task."""
    return NO_KEY if session.task_key is None else session.task_key


def _by_key(indices: Sequence[int], key_of: Callable[[int], object]) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for i in indices:
        groups.setdefault(key_of(i), []).append(i)
    return groups


def _running_shifts(
    sessions: Sequence[SessionReturns], indices: Sequence[int], baseline: RunningBaseline
) -> dict[int, _Shift | None]:
    """Shift by the key's running value, or by the batch mean of the key before it has one."""
    shifts: dict[int, _Shift | None] = {}
    for key, members in _by_key(indices, lambda i: _running_key(sessions[i])).items():
        value = baseline.value(str(key))
        if value is None:
            value = _mean([sessions[i].score for i in members])
        shifts.update({i: _Shift(value) for i in members})
    return shifts


def _group_shifts(
    sessions: Sequence[SessionReturns], indices: Sequence[int], estimator: Estimator, eps: float
) -> dict[int, _Shift | None]:
    shifts: dict[int, _Shift | None] = {}
    for members in _by_key(indices, lambda i: _group_of(sessions[i])).values():
        scores = [sessions[i].score for i in members]
        if estimator == "grpo":
            group_shifts = _normalised_shifts(scores, eps)
        elif estimator == "dr_grpo":
            group_shifts = _centred_shifts(scores)
        else:
            group_shifts = _leave_one_out_shifts(scores)
        shifts.update(zip(members, group_shifts, strict=True))
    return shifts


def _shifts(
    sessions: Sequence[SessionReturns],
    estimator: Estimator,
    baseline: RunningBaseline | None,
    eps: float,
) -> tuple[dict[int, _Shift | None], list[int]]:
    """Each session's shift, and the sessions whose scores update the running baseline."""
    everyone = list(range(len(sessions)))
    if estimator == "reinforce_pp":
        batch_shifts = _normalised_shifts([s.score for s in sessions], eps)
        return dict(enumerate(batch_shifts)), []
    if estimator == "running":
        if baseline is None:
            raise ValueError("the 'running' estimator needs a RunningBaseline")
        return _running_shifts(sessions, everyone, baseline), everyone
    grouped = [i for i in everyone if _group_of(sessions[i]) is not None]
    keyless = [i for i in everyone if _group_of(sessions[i]) is None]
    shifts = _group_shifts(sessions, grouped, estimator, eps)
    if baseline is None:
        shifts.update(dict.fromkeys(keyless, None))
        return shifts, []
    shifts.update(_running_shifts(sessions, keyless, baseline))
    return shifts, keyless


def session_advantages(
    sessions: Sequence[SessionReturns],
    estimator: Estimator,
    baseline: RunningBaseline | None,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per session, the advantage of each turn (see the module docstring for the rules).

    The running baseline is read for the whole batch first and updated afterwards, in batch
    order, with the score of every session it served: sessions of one batch never baseline
    each other through it.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    for i, session in enumerate(sessions):
        if not session.returns:
            raise ValueError(f"session {i} has no turns, so no returns to compute advantages on")
    shifts, served = _shifts(sessions, estimator, baseline, eps)
    advantages = [_apply([shifts[i]] * len(s.returns), s.returns) for i, s in enumerate(sessions)]
    if baseline is not None:
        for i in served:
            baseline.update(_running_key(sessions[i]), sessions[i].score)
    return advantages
