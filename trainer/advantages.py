"""Rewards to per-turn advantages: discounted returns, then one estimator from one table.

**Returns.** A session's turns on its *path* (the turns it continued, in order) get
discounted returns, G_t = r_t + discount * G_{t+1}: r_t is the turn's own reward (none: 0)
and the session reward is added to the last path turn's. A turn the session did not continue
(an *alternative*: another choice of n > 1, or a request it retried) shares neither the session
reward nor later turns' rewards; its return is its own reward, and without one it has none.
The caller decides which turns have returns; this module maps those floats to advantages.

**Estimators.** Each is one entry of `ESTIMATORS`. It pools returns and turns each return G of
the pool into A = (G - b) / s:

    grpo          pool: the group's returns    b = mean                         s = std + eps
    dr_grpo       pool: the group's returns    b = mean                         s = 1
    rloo          pool: the group's returns    b = mean of the other sessions'  s = 1
    reinforce_pp  pool: the batch's returns    b = mean                         s = std + eps
    running       pool: the task's returns     b = the task's running mean      s = 1

The statistics are those of the quantities being normalised: every return of every session in
the pool counts once (a session of three turns brings three). With one turn per session that is
exactly the per-session statistic of GRPO; with more, a pool's advantages sum to zero over its
turns under grpo and dr_grpo, and no grpo or reinforce_pp advantage exceeds sqrt(N - 1) in size
for a pool of N returns (the largest z-score N numbers can reach; std is the population std).

**No contrast, no signal.** A pool of fewer than two sessions has nothing to compare with, and a
pool whose returns are all equal has no spread: every estimator but `running` gives 0 to all its
returns. `running` compares with earlier batches (the first batch of a task is its own
baseline), so equal returns can still differ from the task's running mean: that is its point.

**Groups.** Sessions pool by ``group_key``, else ``task_key`` (a group key and a task key never
share a pool, even if spelled the same). Under a group estimator, a session with neither key is
baselined by the running baseline under the key ``""`` when one is given, and gets 0 otherwise.

This module knows nothing about tokens, storage or torch: it maps floats to floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

EstimatorName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "running"]
NO_KEY = ""  # the running-baseline key of sessions without task (and group) key


def turn_returns(
    turn_rewards: Sequence[float | None], session_reward: float | None, discount: float
) -> list[float]:
    """Discounted return per path turn: G_t = r_t + discount * G_{t+1}.

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


# --- one pool: baselines and scales ---------------------------------------------------------


@dataclass(frozen=True)
class Shift:
    """Turns a return into an advantage: (value - baseline) / scale."""

    baseline: float
    scale: float = 1.0

    def __call__(self, value: float) -> float:
        return (value - self.baseline) / self.scale


# A pool: for each session in it (by index), its returns. An estimator gives each session of
# the pool a Shift, or None where there is no signal (every advantage of that session is 0).
Pool = Mapping[int, Sequence[float]]
Shifts = dict[int, Shift | None]


def _values(pool: Pool) -> list[float]:
    return [value for returns in pool.values() for value in returns]


def _mean(values: Sequence[float]) -> float:
    if max(values) == min(values):  # exactly the value: n * x / n may be off by one ulp
        return float(values[0])
    return math.fsum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    """Population standard deviation."""
    mean = _mean(values)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in values) / len(values))


def _contrast(pool: Pool) -> bool:
    """Two sessions or more, whose returns are not all equal."""
    values = _values(pool)
    return len(pool) >= 2 and bool(values) and max(values) != min(values)


def normalised(pool: Pool, eps: float) -> Shifts:
    """(G - mean) / (std + eps) over every return of the pool."""
    if not _contrast(pool):
        return dict.fromkeys(pool)
    values = _values(pool)
    shift = Shift(_mean(values), _std(values) + eps)
    return dict.fromkeys(pool, shift)


def centred(pool: Pool, eps: float) -> Shifts:
    """G - mean over every return of the pool."""
    if not _contrast(pool):
        return dict.fromkeys(pool)
    return dict.fromkeys(pool, Shift(_mean(_values(pool))))


def leave_one_out(pool: Pool, eps: float) -> Shifts:
    """G - mean of the returns of the pool's *other* sessions."""
    if not _contrast(pool):
        return dict.fromkeys(pool)
    shifts: Shifts = {}
    for index in pool:
        others = [v for other, returns in pool.items() if other != index for v in returns]
        shifts[index] = Shift(_mean(others)) if others else None
    return shifts


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: how sessions pool, and how a pool becomes shifts."""

    pools: Literal["group", "batch", "task"]
    shifts: Callable[[Pool, float], Shifts] | None  # None: the task's running baseline
    help: str


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("group", normalised, "group mean and std"),
    "dr_grpo": Estimator("group", centred, "group mean, no std (Dr. GRPO)"),
    "rloo": Estimator("group", leave_one_out, "mean of the group's other sessions"),
    "reinforce_pp": Estimator("batch", normalised, "batch mean and std (REINFORCE++)"),
    "running": Estimator("task", None, "per-task running mean, for online sessions without groups"),
}


# --- running baseline -----------------------------------------------------------------------


class RunningBaseline:
    """Per-key exponential moving average of the mean return of each session.

    The first value of a key becomes its baseline; later ones move it by ``1 - momentum``. The
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


def against_running(pool: Pool, value: float | None) -> Shifts:
    """G - the key's running value; before it has one, G - the mean of the pool's returns."""
    values = _values(pool)
    if not values:
        return dict.fromkeys(pool)
    return dict.fromkeys(pool, Shift(_mean(values) if value is None else value))


# --- sessions to advantages -----------------------------------------------------------------


@dataclass(frozen=True)
class SessionReturns:
    """One session's grouping keys and the returns of its trained turns."""

    group_key: str | None
    task_key: str | None
    returns: list[float]


def _group_of(session: SessionReturns) -> tuple[str, str] | None:
    if session.group_key is not None:
        return ("group", session.group_key)
    if session.task_key is not None:
        return ("task", session.task_key)
    return None


def _running_key(session: SessionReturns) -> str:
    """Groups are one-off, so the running baseline is kept per task."""
    return NO_KEY if session.task_key is None else session.task_key


def _pools(
    sessions: Sequence[SessionReturns], pools: str
) -> tuple[dict[object, list[int]], dict[str, list[int]]]:
    """Sessions pooled for the estimator, and (keyed by task) those left to the running
    baseline."""
    estimated: dict[object, list[int]] = {}
    running: dict[str, list[int]] = {}
    for i, session in enumerate(sessions):
        if not session.returns:  # nothing trained: not a partner to compare with
            continue
        if pools == "batch":
            estimated.setdefault("batch", []).append(i)
        elif pools == "task":
            running.setdefault(_running_key(session), []).append(i)
        elif (group := _group_of(session)) is not None:
            estimated.setdefault(group, []).append(i)
        else:
            running.setdefault(NO_KEY, []).append(i)
    return estimated, running


def _apply(shift: Shift | None, returns: Sequence[float]) -> list[float]:
    return [0.0 if shift is None else shift(value) for value in returns]


def session_advantages(
    sessions: Sequence[SessionReturns],
    estimator: str,
    baseline: RunningBaseline | None,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per session, the advantage of each of its returns (see the module docstring).

    The running baseline is read for the whole batch first and updated afterwards, with the
    mean return of every session it served, in batch order: sessions of one batch never
    baseline each other through it.
    """
    spec = ESTIMATORS.get(estimator)
    if spec is None:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {tuple(ESTIMATORS)}")
    if spec.pools == "task" and baseline is None:
        raise ValueError("the 'running' estimator needs a RunningBaseline")
    estimated, running = _pools(sessions, spec.pools)
    shifts: Shifts = {}
    for members in estimated.values():
        assert spec.shifts is not None
        shifts.update(spec.shifts({i: sessions[i].returns for i in members}, eps))
    served: list[int] = []
    for key, members in running.items():
        pool = {i: sessions[i].returns for i in members}
        if baseline is None:
            shifts.update(dict.fromkeys(members))
            continue
        shifts.update(against_running(pool, baseline.value(key)))
        served += members
    advantages = [_apply(shifts.get(i), s.returns) for i, s in enumerate(sessions)]
    if baseline is not None:
        for i in sorted(served):
            baseline.update(_running_key(sessions[i]), _mean(sessions[i].returns))
    return advantages
