"""Rewards to per-turn advantages: discounted returns, then one estimator from one table.

**Returns.** A session's turns on its *path* (the turns it went on from, in order) get
discounted returns, G_t = r_t + discount * G_{t+1}: r_t is the turn's own reward (none: 0)
and the session reward is added to the last path turn's. A turn the session did not go on from
(an *alternative*: another choice of n > 1, or a request it retried) shares neither the session
reward nor later turns' rewards; its return is its own reward, and without one it has none. Its
position is that of the path turn its request led to. The caller decides which turns have
returns; this module maps those floats to advantages.

**Rewards first.** Before returns are computed, each reward as recorded (a turn's own, the
session's) may be shaped: DAPO's soft overlong penalty (`overlong_penalty`) is added to a turn's
own reward, then the reward is multiplied by the run's scale and clipped (`shaped_reward`). The
caller applies them; the returns see only the shaped rewards.

**Estimators.** Each is one entry of `ESTIMATORS`. Returns are compared position by position
along the path: the pool at position t holds the group's returns at t, and a session whose path
ended before t stands in with its *outcome* (its last path return), as a finished episode's
result. Each return G at t becomes A = (G - b) / s:

    grpo                   pool: the group's at t   b = mean                        s = scale
    dr_grpo                pool: the group's at t   b = mean                        s = 1
    rloo                   pool: the group's at t   b = the other sessions' mean    s = 1
    reinforce_pp           pool: the batch's at t   b = mean                        s = scale
    lite_ppo               pool: the group's at t   b = mean                        s = batch
    reinforce_pp_baseline  pool: the group's at t   b = mean                        s = centred
    running                the task                 b = running mean of outcomes    s = 1

A pool holds returns. ``scale`` is the std of the pool's values plus eps; ``batch`` the std of
the batch's values at t (every group's pool at t together) plus eps; ``centred`` the std over
the batch at t of each value less its group's mean, plus eps. lite_ppo is LitePPO's
normalisation (Liu et al. 2025, "Part I: Tricks or Traps?", arXiv 2508.08221: group-level
mean, batch-level std); reinforce_pp_baseline is REINFORCE++-baseline (Hu et al., arXiv
2501.03262: subtract the group mean, then normalise by the batch's std of what is left). They
are not one formula: the batch std of the returns holds the spread *between* groups' means
too, the other only the spread within groups; they agree when every group has the same mean
(one group in the batch, say). REINFORCE++-baseline also subtracts the batch mean of the
group-centred values, which is 0 by construction (each group's centred values sum to 0): it
changes nothing but rounding, and is left out. ``advantage_std`` picks the std's form:
``population`` (divide by N: GRPO's paper, and the default) or ``sample`` (Bessel's N - 1, as
TRL and verl compute it).

With one reward per session and no discount every return of a session is its reward, so every
position gives exactly the per-session GRPO (Dr. GRPO, RLOO, REINFORCE++) advantage, whatever
the sessions' lengths. With a discount or per-turn rewards, a return is only compared with
returns at the same position, so returns that differ only by where in a session they fall get
nothing from it.

**Under a discount, the outcome and the discount's part are scaled apart.** A return G is its
undiscounted value U (the same rewards at discount 1, stand-ins included) less what the discount
took off it, D = G - U. grpo and reinforce_pp give

    A = (U - mean U) / (std U + eps)  +  (D - mean D) / max(std U, mean |U|)

over the position's pool: the outcomes' usual z-score, plus the discount's part measured in the
outcomes' own size, never in its own spread (every outcome 0: no signal). Normalising G by the
std of the discounted returns, as before, blew a pure difference in length up to unit size:
four sessions that all succeed in 1 to 4 turns got -1.7..+1.4 at any discount below 1. Now
sessions that reach the same outcome R once, at the end, after paths of at most L turns get
|A| <= 1 - discount^L (<= L * (1 - discount)), which goes to 0 as the discount goes to 1, and a
tiny spread of outcomes never magnifies a large spread of lengths. At discount 1, D = 0 and A
is the usual (G - mean) / (std + eps), bit for bit: no advantage then exceeds sqrt(N - 1) in
size, N the values in its position's pool (the largest z-score N numbers can reach under the
population std; (N - 1) / sqrt(N) under the sample std). The batch-scaled estimators split the
same way, with the batch's statistics of U (spread, mean |U|) in place of the pool's.

**No contrast, no signal.** A pool of fewer than two sessions has nothing to compare with, and a
pool whose values are all equal has no spread: every estimator but `running` gives 0 there.
`running` compares with earlier batches (the first batch of a task is its own baseline), so
equal returns can still differ from the task's running mean: that is its point.

**Groups.** Sessions pool by ``group_key``, else ``task_key`` (a group key and a task key never
share a pool, even if spelled the same). Under a group estimator, a session with neither key is
baselined by the running baseline under the key ``""`` when one is given, and gets 0 otherwise.

This module knows nothing about tokens, storage or torch: it maps floats to floats. The bounds
of its settings (discount, momentum) are checked once, by the trainer's config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

EstimatorName = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "reinforce_pp_baseline", "running"
]
StdForm = Literal["population", "sample"]  # divide the squared deviations by N, or N - 1
NO_KEY = ""  # the running-baseline key of sessions without task (and group) key


def turn_returns(
    turn_rewards: Sequence[float | None], session_reward: float | None, discount: float
) -> list[float]:
    """Discounted return per path turn: G_t = r_t + discount * G_{t+1}.

    r_t is the turn's own reward (None counts as 0); the session reward is added to the last
    turn's reward. A session without turns has no returns.
    """
    rewards = [0.0 if r is None else float(r) for r in turn_rewards]
    if rewards and session_reward is not None:
        rewards[-1] += float(session_reward)
    returns = [0.0] * len(rewards)
    following = 0.0
    for t in reversed(range(len(rewards))):
        following = rewards[t] + discount * following
        returns[t] = following
    return returns


# --- rewards before returns: DAPO's length penalty, scale, clip --------------------------------


def overlong_penalty(length: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13) of an answer
    of ``length`` tokens: 0 up to L_max - L_cache, then falling linearly,
    ((L_max - L_cache) - length) / L_cache, to -1 at L_max, and -1 beyond."""
    free = max_tokens - cache_tokens
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / cache_tokens
    return -1.0


def shaped_reward(reward: float, scale: float, clip: float | None) -> float:
    """A reward multiplied by ``scale``, then clipped to [-clip, clip]: clipping after scaling
    keeps the bound in the units the returns are computed in, whatever the scale. A reward
    that is not a finite number is returned as it is (clipping would hide it; the caller
    refuses it)."""
    if not math.isfinite(reward):
        return reward
    value = reward * scale
    return value if clip is None else min(max(value, -clip), clip)


# --- one pool: baselines and scales ---------------------------------------------------------


@dataclass(frozen=True)
class Shift:
    """Turns a return into an advantage: (value - baseline) / scale. A split shift (a normalised
    estimator under a discount) takes the return's undiscounted part U and what the discount
    took off it, D = G - U, apart: (U - outcome[0]) / outcome[1] + (D - baseline) / scale."""

    baseline: float
    scale: float = 1.0
    outcome: tuple[float, float] | None = None  # (baseline, scale) of U, when split

    def __call__(self, value: float, undiscounted: float) -> float:
        if self.outcome is None:
            return (value - self.baseline) / self.scale
        outcome_baseline, outcome_scale = self.outcome
        discounted_by = value - undiscounted
        return (undiscounted - outcome_baseline) / outcome_scale + (
            discounted_by - self.baseline
        ) / self.scale


@dataclass(frozen=True)
class Pool:
    """One position's pool: for each session in it (by index), its returns there, and the same
    values undiscounted (the same sessions, the same number of values each)."""

    returns: Mapping[int, Sequence[float]]
    undiscounted: Mapping[int, Sequence[float]]


# An estimator gives each session of a pool a Shift, or None where there is no signal (its
# advantages there are 0).
Shifts = dict[int, Shift | None]


def _values(values_of: Mapping[int, Sequence[float]]) -> list[float]:
    return [value for values in values_of.values() for value in values]


def _mean(values: Sequence[float]) -> float:
    if max(values) == min(values):  # exactly the value: n * x / n may be off by one ulp
        return float(values[0])
    return math.fsum(values) / len(values)


@dataclass(frozen=True)
class Norm:
    """How the normalised estimators scale: eps added to the std, and the std's form."""

    eps: float = 1e-6
    std: StdForm = "population"


def _std(values: Sequence[float], form: StdForm = "population") -> float:
    """Standard deviation (population: over N; sample: over N - 1), scaled so that no square
    overflows. One value has no sample std: 0."""
    mean = _mean(values)
    deviations = [x - mean for x in values]
    largest = max(abs(d) for d in deviations)
    count = len(values) - (1 if form == "sample" else 0)
    if largest == 0 or count <= 0:
        return 0.0
    return largest * math.sqrt(math.fsum((d / largest) ** 2 for d in deviations) / count)


def _contrast(pool: Pool) -> bool:
    """Two sessions or more, whose returns are not all equal."""
    values = _values(pool.returns)
    return len(pool.returns) >= 2 and max(values) != min(values)


def _scaled(pool: Pool, spread: float, size: float, norm: Norm) -> Shifts:
    """(G - mean) / (spread + eps) over the pool's values, ``spread`` the std of the values the
    estimator scales by (U at discount 1: G itself); under a discount, split (see the module
    docstring): the outcomes' part over spread + eps, what the discount took off each return
    over max(spread, size), ``size`` the mean |U| of the same values."""
    returns, undiscounted = _values(pool.returns), _values(pool.undiscounted)
    if returns == undiscounted:  # no discount at work: the usual z-score, bit for bit
        return dict.fromkeys(pool.returns, Shift(_mean(returns), spread + norm.eps))
    unit = max(spread, size)
    if unit == 0:  # every outcome 0: nothing to measure the discount's part in
        return dict.fromkeys(pool.returns)
    discounted_by = [g - u for g, u in zip(returns, undiscounted, strict=True)]
    outcome = (_mean(undiscounted), spread + norm.eps)
    return dict.fromkeys(pool.returns, Shift(_mean(discounted_by), unit, outcome))


def _size(values: Sequence[float]) -> float:
    return _mean([abs(v) for v in values])


def normalised(pool: Pool, batch: Sequence[Pool], norm: Norm) -> Shifts:
    """(G - mean) / (std + eps) over every value of the pool; under a discount, split (see the
    module docstring): the outcomes' z-score, plus what the discount took off each return
    measured in the outcomes' own size, never in its own spread."""
    if not _contrast(pool):
        return dict.fromkeys(pool.returns)
    undiscounted = _values(pool.undiscounted)
    return _scaled(pool, _std(undiscounted, norm.std), _size(undiscounted), norm)


def batch_scaled(pool: Pool, batch: Sequence[Pool], norm: Norm) -> Shifts:
    """(G - group mean) / (batch std + eps): the pool's mean, the std of every value at this
    position in the batch (LitePPO); split under a discount as `normalised` is."""
    if not _contrast(pool):
        return dict.fromkeys(pool.returns)
    everything = [u for other in batch for u in _values(other.undiscounted)]
    return _scaled(pool, _std(everything, norm.std), _size(everything), norm)


def batch_scaled_centred(pool: Pool, batch: Sequence[Pool], norm: Norm) -> Shifts:
    """(G - group mean) / (batch std of G - group mean, + eps) (REINFORCE++-baseline): the
    spread within groups only; split under a discount as `normalised` is."""
    if not _contrast(pool):
        return dict.fromkeys(pool.returns)
    centred_values = []
    for other in batch:
        values = _values(other.undiscounted)
        if values:  # a group none of whose sessions trains at this position brings nothing
            mean = _mean(values)
            centred_values += [u - mean for u in values]
    everything = [u for other in batch for u in _values(other.undiscounted)]
    return _scaled(pool, _std(centred_values, norm.std), _size(everything), norm)


def centred(pool: Pool, batch: Sequence[Pool], norm: Norm) -> Shifts:
    """G - mean over every value of the pool."""
    if not _contrast(pool):
        return dict.fromkeys(pool.returns)
    return dict.fromkeys(pool.returns, Shift(_mean(_values(pool.returns))))


def leave_one_out(pool: Pool, batch: Sequence[Pool], norm: Norm) -> Shifts:
    """G - mean of the values of the pool's *other* sessions."""
    if not _contrast(pool):
        return dict.fromkeys(pool.returns)
    return {
        index: Shift(_mean([v for other, vs in pool.returns.items() if other != index for v in vs]))
        for index in pool.returns
    }


# A pool's shifts, given every pool of the batch at the same position (itself among them).
ShiftsOf = Callable[[Pool, Sequence[Pool], Norm], Shifts]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: how sessions pool, and how a pool becomes shifts."""

    pools: Literal["group", "batch", "task"]
    shifts: ShiftsOf | None  # None: the task's running baseline
    help: str
    uses_std: bool = False  # divides by a std (advantage_std applies)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("group", normalised, "group mean and std", uses_std=True),
    "dr_grpo": Estimator("group", centred, "group mean, no std (Dr. GRPO)"),
    "rloo": Estimator("group", leave_one_out, "mean of the group's other sessions"),
    "reinforce_pp": Estimator(
        "batch", normalised, "batch mean and std (REINFORCE++)", uses_std=True
    ),
    "lite_ppo": Estimator(
        "group", batch_scaled, "group mean, batch std of the returns (LitePPO)", uses_std=True
    ),
    "reinforce_pp_baseline": Estimator(
        "group",
        batch_scaled_centred,
        "group mean, batch std of the group-centred returns (REINFORCE++-baseline)",
        uses_std=True,
    ),
    "running": Estimator("task", None, "per-task running mean, for online sessions without groups"),
}


# --- running baseline -----------------------------------------------------------------------


class RunningBaseline:
    """Per-key exponential moving average of the sessions' outcomes (last path returns).

    The first value of a key becomes its baseline; later ones move it by ``1 - momentum``. The
    state is a plain ``{key: value}`` dict of floats, so the trainer can checkpoint it as JSON.
    """

    def __init__(self, momentum: float) -> None:
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


# --- sessions to advantages -----------------------------------------------------------------


@dataclass(frozen=True)
class SessionReturns:
    """One session's grouping keys and the returns of its trained turns.

    ``positions[i]`` is where along the path ``returns[i]`` falls (default 0, 1, 2, ...);
    ``length`` is the path's length (default: the number of returns) and ``outcome`` its last
    return (default: the last of ``returns``): from position ``length`` on, the session stands
    in with its outcome. ``undiscounted`` holds the same returns at discount 1 (None: equal to
    ``returns``) and ``undiscounted_outcome`` the outcome at discount 1 (None: equal to
    ``outcome``); the normalised estimators take their scale from them.
    """

    group_key: str | None
    task_key: str | None
    returns: list[float]
    positions: list[int] = field(default_factory=list)
    length: int | None = None
    outcome: float | None = None
    undiscounted: list[float] | None = None
    undiscounted_outcome: float | None = None

    def __post_init__(self) -> None:
        if not self.positions:
            object.__setattr__(self, "positions", list(range(len(self.returns))))
        if self.length is None:
            object.__setattr__(self, "length", max(self.positions, default=-1) + 1)
        if self.outcome is None and self.returns:
            object.__setattr__(self, "outcome", self.returns[-1])
        if self.undiscounted is not None and len(self.undiscounted) != len(self.returns):
            raise ValueError("undiscounted needs one value per return")

    def at(self, position: int) -> list[float]:
        """Its values at ``position``: its own returns there, else its outcome once its path
        has ended."""
        return self._at(position, self.returns, self.outcome)

    def undiscounted_at(self, position: int) -> list[float]:
        """The same values as `at`, undiscounted."""
        undiscounted = self.returns if self.undiscounted is None else self.undiscounted
        outcome = self.outcome if self.undiscounted_outcome is None else self.undiscounted_outcome
        return self._at(position, undiscounted, outcome)

    def _at(self, position: int, returns: list[float], outcome: float | None) -> list[float]:
        own = [g for g, p in zip(returns, self.positions, strict=True) if p == position]
        if own or self.length is None or position < self.length or outcome is None:
            return own
        return [outcome]


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
    baseline. A session with no returns is nobody's partner."""
    estimated: dict[object, list[int]] = {}
    running: dict[str, list[int]] = {}
    for i, session in enumerate(sessions):
        if not session.returns:
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


def pool_sizes(
    sessions: Sequence[SessionReturns], estimator: str, baseline: RunningBaseline | None
) -> list[int | None]:
    """Per session, how many sessions its advantages were compared among, itself included (1:
    it had no partner; 0: it has no returns), or None where the running baseline set them.

    A batch step's dynamic sampling reads it to say why a session got no signal.
    """
    estimated, running = _pools(sessions, _estimator(estimator).pools)
    sizes: list[int | None] = [0] * len(sessions)
    for members in estimated.values():
        for i in members:
            sizes[i] = len(members)
    for members in running.values():
        for i in members:
            sizes[i] = None if baseline is not None else 1
    return sizes


def _estimator(name: str) -> Estimator:
    spec = ESTIMATORS.get(name)
    if spec is None:
        raise ValueError(f"unknown estimator {name!r}; expected one of {tuple(ESTIMATORS)}")
    return spec


def _extent(sessions: Sequence[SessionReturns], members: Iterable[int]) -> int:
    """One past the last position along the members' paths."""
    return max(max(max(s.positions) + 1, s.length or 0) for s in map(sessions.__getitem__, members))


def _position_pools(
    sessions: Sequence[SessionReturns], members: list[int], last: int | None = None
) -> Iterator[tuple[int, Pool]]:
    """The pool of each position along the members' paths (up to ``last``, if given: past
    their paths every member stands in with its outcome)."""
    for position in range(_extent(sessions, members) if last is None else last):
        present = [i for i in members if sessions[i].at(position)]
        yield (
            position,
            Pool(
                returns={i: sessions[i].at(position) for i in present},
                undiscounted={i: sessions[i].undiscounted_at(position) for i in present},
            ),
        )


def _by_position(
    sessions: Sequence[SessionReturns],
    groups: Iterable[list[int]],
    shifts_of: ShiftsOf,
    norm: Norm,
) -> dict[tuple[int, int], Shift | None]:
    """The shift of each (session, position), from the pool of each group at each position
    (and every group's pool at that position, for the estimators that scale by the batch: a
    group whose paths have all ended is there too, its sessions standing in with their
    outcomes, as in reinforce_pp's one pool)."""
    groups = list(groups)
    last = _extent(sessions, [i for members in groups for i in members])
    at: dict[int, list[Pool]] = {}
    for members in groups:
        for position, pool in _position_pools(sessions, members, last):
            at.setdefault(position, []).append(pool)
    out: dict[tuple[int, int], Shift | None] = {}
    for position, pools in at.items():
        for pool in pools:
            for i, shift in shifts_of(pool, pools, norm).items():
                out[(i, position)] = shift
    return out


def contrasted(
    sessions: Sequence[SessionReturns], estimator: str, baseline: RunningBaseline | None
) -> list[bool | None]:
    """Per session, whether any pool it was compared in had contrast (two sessions or more whose
    returns differ); None where the running baseline set its advantages. Dynamic sampling
    leaves out the sessions of groups without contrast, not a member that sits at its group's
    mean."""
    estimated, running = _pools(sessions, _estimator(estimator).pools)
    out: list[bool | None] = [False] * len(sessions)
    for members in estimated.values():
        for _, pool in _position_pools(sessions, members):
            if _contrast(pool):
                for i in pool.returns:
                    out[i] = True
    if baseline is not None:
        for members in running.values():
            for i in members:
                out[i] = None
    return out


def session_advantages(
    sessions: Sequence[SessionReturns],
    estimator: str,
    baseline: RunningBaseline | None,
    eps: float = 1e-6,
    std: StdForm = "population",
) -> list[list[float]]:
    """Per session, the advantage of each of its returns (see the module docstring); ``eps``
    and ``std`` (the std's form) are the normalised estimators'.

    The running baseline is read for the whole batch first and updated afterwards, with the
    outcome of every session it served, in batch order: sessions of one batch never baseline
    each other through it.
    """
    spec = _estimator(estimator)
    if spec.pools == "task" and baseline is None:
        raise ValueError("the 'running' estimator needs a RunningBaseline")
    estimated, running = _pools(sessions, spec.pools)
    shifts: dict[tuple[int, int], Shift | None] = {}
    if estimated:
        assert spec.shifts is not None
        shifts = _by_position(sessions, estimated.values(), spec.shifts, Norm(eps, std))
    served: list[int] = []
    for key, members in running.items():
        if baseline is None:
            continue  # no shift: no signal
        value = baseline.value(key)
        if value is None:  # a new key: its own sessions' mean outcome
            value = _mean([sessions[i].outcome for i in members])  # type: ignore[misc]
        for i in members:
            shifts.update({(i, p): Shift(value) for p in sessions[i].positions})
        served += members
    advantages = [
        [
            0.0 if (shift := shifts.get((i, p))) is None else shift(g, u)
            for g, u, p in zip(s.returns, s.undiscounted or s.returns, s.positions, strict=True)
        ]
        for i, s in enumerate(sessions)
    ]
    if baseline is not None:
        for i in sorted(served):
            baseline.update(_running_key(sessions[i]), sessions[i].outcome)  # type: ignore[arg-type]
    return advantages
