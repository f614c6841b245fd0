"""Claimed sessions → training samples, or a reason why a session cannot be one.

The server sends each claimed session as rows (``input_ids``, ``loss_mask``, behaviour
``logprobs``, per-token ``versions``) whose turns carry their span, reward, sampling temperature
and whether the session continued them (``alternative``). This module decides, per session:

- **dropped, with a reason** (never an exception: bad data must not stop the trainer): no turns;
  a return that is not a finite number; a row longer than the per-row limit; under
  ``stale=drop`` a token too stale; nothing left to train once tokens are masked; or, under
  ``dynamic_sampling``, every advantage 0. Only tokens that could train decide a drop (an
  alternative without a reward of its own trains nothing). The trainer tells the server at
  once, so a dropped session stops counting against admission;
- **masked tokens, counted by cause**: under ``stale=mask``, tokens more than ``max_staleness``
  updates behind (`staleness.versions_behind`); greedy turns, always; turns sampled at another
  temperature than the training one under ``off_temperature=mask``; alternatives without a
  reward of their own; under ``overlong_filter`` (DAPO), turns the length limit cut (their
  ``finish_reason`` is ``length``; a server that does not say is taken as not cut), masked
  rather than dropped because a session's other turns are still good samples (a session with
  nothing else to train is dropped as any fully masked one is, and so leaves its group's
  statistics). Under ``stale=keep`` (the default) nothing is masked for staleness: the
  server's admission bound limits how far generation runs ahead, and the loss's behaviour
  weight pi_prox / pi_behav corrects what is stale;
- **off-policy tokens**: under ``off_temperature=off_policy`` a turn sampled at another
  temperature keeps its stored logprob as the behaviour logprob (the distribution it was really
  drawn from). A greedy turn has no such distribution (argmax is a point mass, which no
  importance weight corrects), so it is masked under either setting;
- **advantages**: each reward shaped first (a turn's own reward plus DAPO's soft overlong
  penalty of its length, then ``reward_scale``, then ``reward_clip``; the session's reward
  scaled and clipped), discounted returns along the session's path, a rewarded alternative's
  own reward, then the run's estimator (`advantages`) over the returns of the turns that train
  (with the same returns undiscounted, from which the normalised estimators take their scale).

Every loss token a batch saw is trained, masked (``Batch.masked``) or dropped with its session
(``Batch.dropped_tokens``): ``Batch.sampled_tokens`` is their sum. One definition, whether the
session is kept or dropped, and at whichever point: an alternative without a reward of its own
is masked as ``alternative``, every other token could train. ``Batch.tallies`` keeps that split
per dropped session (a restarted trainer counts a dropped claim's sessions from it).

Pure: it knows nothing about HTTP, Ray or torch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.advantages import (
    ESTIMATORS,
    RunningBaseline,
    SessionReturns,
    contrasted,
    overlong_penalty,
    pool_sizes,
    session_advantages,
    shaped_reward,
    turn_returns,
)
from trainer.config import AlgorithmConfig
from trainer.staleness import Republish, versions_behind

# Facts of the wire protocol the trainer reads (it reaches the server only over HTTP):
GREEDY_BELOW = 1e-6  # a temperature below this is greedy decoding (SGLang's rule, its engine's)
SAME_TEMPERATURE = 1e-6  # temperatures this close are the same distribution

# Why loss tokens were masked out: the keys of Batch.masked.
STALE, GREEDY, OFF_TEMPERATURE, ALTERNATIVE = "stale", "greedy", "off_temperature", "alternative"
OVERLONG = "overlong"  # a turn cut by the length limit, under overlong_filter (DAPO)
CUT_BY_LENGTH = "length"  # the finish_reason of a turn the length limit cut


@dataclass
class Sample:
    """One training row."""

    session_id: str
    input_ids: list[int]
    loss_mask: list[int]
    behaviour: list[float]  # the behaviour logprob of each token (0 on prompt tokens)
    versions: list[int]  # the policy version that sampled each token (-1 on prompt tokens)
    advantages: list[float] = field(default_factory=list)
    # 1 on loss tokens sampled at the training temperature by the very weights the step starts
    # from: there the engine's and the trainer's logprobs should agree, so their gap measures
    # the mismatch between the two.
    fresh: list[int] = field(default_factory=list)
    # algorithm.critic: each token's reward, for GAE (empty: none given, every reward 0)
    rewards: list[float] = field(default_factory=list)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Tally:
    """What became of a dropped session's loss tokens: masked, by cause, or dropped with it
    (those that could have trained)."""

    masked: Counter[str] = field(default_factory=Counter)
    dropped_tokens: int = 0

    @property
    def sampled_tokens(self) -> int:
        return sum(self.masked.values()) + self.dropped_tokens


@dataclass
class Batch:
    samples: list[Sample]
    session_ids: list[str]  # every claimed session, trained or dropped
    dropped: dict[str, str] = field(default_factory=dict)  # session id -> why
    # per session with turns: its outcome, undiscounted (its path's rewards and the session's)
    # (as recorded: before the overlong penalty, reward_scale and reward_clip)
    rewards: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)  # the same sessions' discounted G_0
    staleness: list[int] = field(default_factory=list)  # updates behind, per trained token
    masked: Counter[str] = field(default_factory=Counter)  # loss tokens masked, by cause
    # loss tokens that could train, of sessions dropped with them unmasked (not in `masked`)
    dropped_tokens: int = 0
    off_policy_tokens: int = 0  # off-temperature tokens trained with their own behaviour logprob
    # per dropped session, what became of its tokens (in `masked` and `dropped_tokens` too)
    tallies: dict[str, Tally] = field(default_factory=dict)

    @property
    def sessions(self) -> int:
        return len(self.session_ids)

    @property
    def dropped_sessions(self) -> int:
        return len(self.dropped)

    @property
    def stale_tokens(self) -> int:
        return self.masked[STALE]

    @property
    def loss_tokens(self) -> int:
        return sum(s.loss_tokens for s in self.samples)

    @property
    def sampled_tokens(self) -> int:
        """Every loss token the batch saw: trained, masked or dropped with its session."""
        return self.loss_tokens + sum(self.masked.values()) + self.dropped_tokens


@dataclass(frozen=True)
class Rules:
    """What decides, for one step, which tokens train and how."""

    algorithm: AlgorithmConfig  # resolved: temperature and off_temperature are set
    policy_version: int
    max_staleness: int
    republished: Sequence[Republish] = ()
    row_limit: int | None = None  # the longest row trained (resolved max_tokens_per_row)
    row_limit_name: str = "algorithm.max_tokens_per_row"  # what the drop reason names

    @property
    def temperature(self) -> float:
        assert self.algorithm.temperature is not None, "resolve the run's temperature first"
        return self.algorithm.temperature

    def behind(self, version: int) -> int:
        return versions_behind(version, self.policy_version, self.republished)


@dataclass
class _Turn:
    row: int  # position of its row in the session's rows
    start: int
    end: int
    order: int  # turn_index (else its position in the session)
    reward: float | None
    temperature: float | None
    alternative: bool
    finish_reason: str | None = None  # None: the server did not say
    position: int = 0  # where along the session's path it falls
    value: float | None = None  # its return (None: an alternative without a reward of its own)
    undiscounted: float | None = None  # the same return at discount 1
    trains: bool = False  # any loss token left after masking


@dataclass
class _Session:
    """One claimed session's turns with their returns, and its path."""

    data: dict[str, Any]
    turns: list[_Turn]
    length: int  # turns on the path
    outcome: float | None  # the last path turn's return (the same at any discount)
    recorded: float = 0.0  # its path's G_0 at discount 1 from its rewards as recorded (unshaped)

    @property
    def first(self) -> _Turn | None:
        return min(
            (t for t in self.turns if not t.alternative), key=lambda t: t.order, default=None
        )

    @property
    def first_return(self) -> float:
        """Its path's G_0, discounted."""
        return 0.0 if self.first is None or self.first.value is None else self.first.value

    def unmasked(self) -> Tally:
        """Its loss tokens when it is dropped before masking: an alternative without a return
        is masked as `ALTERNATIVE` (as it is in a kept session), every other token could have
        trained and is dropped with it."""
        rows = self.data["rows"]
        tally = Tally()
        for t in self.turns:
            n = sum(rows[t.row]["loss_mask"][t.start : t.end])
            if t.value is None:
                tally.masked[ALTERNATIVE] += n
            else:
                tally.dropped_tokens += n
        tally.masked = +tally.masked  # no cause with 0 tokens
        return tally


def _turn_reward(turn: _Turn, algorithm: AlgorithmConfig) -> float | None:
    """A turn's own reward as the returns see it: its recorded reward plus, under the soft
    overlong penalty, the penalty of its length (an alternative without a reward of its own
    gets none: it trains nothing), then scaled and clipped."""
    reward = turn.reward
    longest, cache = algorithm.overlong_max_tokens, algorithm.overlong_cache_tokens
    if longest is not None and cache is not None and (reward is not None or not turn.alternative):
        penalty = overlong_penalty(turn.end - turn.start, longest, cache)
        if penalty:
            reward = (0.0 if reward is None else float(reward)) + penalty
    if reward is None:
        return None
    return shaped_reward(float(reward), algorithm.reward_scale, algorithm.reward_clip)


def _session(data: dict[str, Any], algorithm: AlgorithmConfig) -> _Session:
    """The session's turns, each with its return (from its shaped rewards) and its position
    along the path."""
    turns: list[_Turn] = []
    for r, row in enumerate(data["rows"]):
        for turn in row["turns"]:
            turns.append(
                _Turn(
                    row=r,
                    start=turn["start"],
                    end=turn["end"],
                    order=turn.get("turn_index", len(turns)),
                    reward=turn.get("reward"),
                    temperature=turn.get("temperature"),
                    alternative=bool(turn.get("alternative", False)),
                    finish_reason=turn.get("finish_reason"),
                )
            )
    path = sorted((t for t in turns if not t.alternative), key=lambda t: t.order)
    session_reward = data.get("reward")
    if session_reward is not None:
        session_reward = shaped_reward(
            float(session_reward), algorithm.reward_scale, algorithm.reward_clip
        )
    rewards = [_turn_reward(t, algorithm) for t in path]
    returns = turn_returns(rewards, session_reward, algorithm.discount)
    undiscounted = turn_returns(rewards, session_reward, 1.0)
    for position, turn in enumerate(path):
        turn.position = position
        turn.value, turn.undiscounted = returns[position], undiscounted[position]
    for turn in turns:
        if turn.alternative:  # where its request stood on the path
            turn.position = sum(1 for t in path if t.order < turn.order)
            turn.value = turn.undiscounted = _turn_reward(turn, algorithm)
    recorded = turn_returns([t.reward for t in path], data.get("reward"), 1.0)
    outcome = returns[-1] if returns else None
    return _Session(data, turns, len(path), outcome, recorded[0] if recorded else 0.0)


# --- why a session cannot train -------------------------------------------------------------


def _drop_before_masking(session: _Session, rules: Rules) -> str | None:
    """Only tokens that could train count: an alternative without a reward trains nothing."""
    if not session.turns:
        return "no_turns: the session has no model call to train on"
    values = [t.value for t in session.turns if t.value is not None]
    if not all(math.isfinite(v) for v in values):
        return "bad_reward: its rewards add up to a return that is not a finite number"
    rows = session.data["rows"]
    counted = [t for t in session.turns if t.value is not None]
    limit = rules.row_limit
    longest = max((len(rows[t.row]["input_ids"]) for t in counted), default=0)
    if limit is not None and longest > limit:
        return (
            f"row_too_long: a row of {longest} tokens, more than {rules.row_limit_name} ({limit})"
        )
    if rules.algorithm.stale == "drop":
        sampled = [v for t in counted for v in rows[t.row]["versions"][t.start : t.end]]
        lag = max((rules.behind(v) for v in sampled), default=0)
        if lag > rules.max_staleness:
            return (
                f"stale: tokens sampled {lag} updates before the trained policy, more than "
                f"max_staleness ({rules.max_staleness}); algorithm.stale=drop"
            )
    return None


def _nothing_to_train(masked: Counter[str], empty: int, rules: Rules) -> str:
    parts = []
    if masked[GREEDY]:
        parts.append(
            f"{masked[GREEDY]} decoded greedily (a point mass: no behaviour distribution to "
            "importance-correct)"
        )
    if masked[OFF_TEMPERATURE]:
        parts.append(
            f"{masked[OFF_TEMPERATURE]} sampled at another temperature than the run's "
            f"{rules.temperature:g} (off_temperature=mask)"
        )
    if masked[STALE]:
        parts.append(
            f"{masked[STALE]} more than max_staleness ({rules.max_staleness}) behind "
            "(algorithm.stale=mask)"
        )
    if masked[ALTERNATIVE]:
        parts.append(f"{masked[ALTERNATIVE]} in alternatives the session did not continue")
    if masked[OVERLONG]:
        parts.append(f"{masked[OVERLONG]} in answers cut by the length limit (overlong_filter)")
    if not parts:
        return f"no_trainable_tokens: its {empty} turn(s) sampled no token"
    return "no_trainable_tokens: every sampled token was masked: " + ", ".join(parts)


# --- masking --------------------------------------------------------------------------------


def _temperature_rule(temperature: float | None, rules: Rules) -> str:
    """ "on" (the training distribution), "greedy", "mask" or "off_policy"."""
    if temperature is not None and temperature < GREEDY_BELOW:
        return "greedy"  # argmax: a point mass, which no behaviour weight corrects
    if temperature is not None and abs(temperature - rules.temperature) <= SAME_TEMPERATURE:
        return "on"
    if temperature is None or rules.algorithm.off_temperature != "off_policy":
        return "mask"  # an unknown temperature is never trained as if known
    return "off_policy"


def _sample(session_id: str, row: dict[str, Any]) -> Sample:
    return Sample(
        session_id=session_id,
        input_ids=list(row["input_ids"]),
        loss_mask=list(row["loss_mask"]),
        behaviour=list(row["logprobs"]),
        versions=list(row["versions"]),
        advantages=[0.0] * len(row["input_ids"]),
        fresh=[0] * len(row["input_ids"]),
        rewards=[0.0] * len(row["input_ids"]),
    )


@dataclass
class _Masked:
    rows: list[Sample]
    masked: Counter[str] = field(default_factory=Counter)
    staleness: list[int] = field(default_factory=list)
    off_policy: int = 0


def _turn_cause(turn: _Turn, rule: str, rules: Rules) -> str | None:
    """Why every token of the turn is masked, if one reason holds for the whole turn."""
    if turn.value is None:
        return ALTERNATIVE
    if rule == "greedy":
        return GREEDY
    if rule == "mask":
        return OFF_TEMPERATURE
    if rules.algorithm.overlong_filter and turn.finish_reason == CUT_BY_LENGTH:
        return OVERLONG
    return None


def _mask(session: _Session, rules: Rules) -> _Masked:
    """The session's rows with every mask applied; marks which turns still train."""
    out = _Masked([_sample(session.data["session_id"], row) for row in session.data["rows"]])
    mask_stale = rules.algorithm.stale == "mask"  # under drop a stale session never gets here
    for turn in session.turns:
        row = out.rows[turn.row]
        rule = _temperature_rule(turn.temperature, rules)
        whole_turn = _turn_cause(turn, rule, rules)
        for i in range(turn.start, turn.end):
            if not row.loss_mask[i]:
                continue
            behind = rules.behind(row.versions[i])
            cause = whole_turn
            if cause is None and mask_stale and behind > rules.max_staleness:
                cause = STALE
            if cause is not None:
                row.loss_mask[i] = 0
                out.masked[cause] += 1
                continue
            turn.trains = True
            out.staleness.append(behind)
            if rule == "off_policy":
                out.off_policy += 1
            else:
                row.fresh[i] = int(row.versions[i] == rules.policy_version)
    return out


# --- the batch ------------------------------------------------------------------------------


def _returns(session: _Session) -> SessionReturns:
    """What the estimator sees of a session: the returns of the turns that train."""
    trained = [t for t in session.turns if t.trains]
    return SessionReturns(
        group_key=session.data.get("group_id"),
        task_key=session.data.get("task_id"),
        returns=[t.value for t in trained],  # type: ignore[misc]
        positions=[t.position for t in trained],
        length=session.length,
        outcome=session.outcome,
        undiscounted=[t.undiscounted for t in trained],  # type: ignore[misc]
        undiscounted_outcome=session.outcome,  # the last return is not discounted
    )


def _without_contrast(
    returns: Sequence[SessionReturns],
    advantages: list[list[float]],
    rules: Rules,
    baseline: RunningBaseline | None,
) -> dict[int, str]:
    """Under dynamic sampling (DAPO), the kept sessions whose every advantage is 0, with why.

    Not under the running baseline (the `running` estimator, or a session without group or
    task key that it baselines): there a 0 is a rare coincidence, not a group without contrast.
    """
    algorithm = rules.algorithm
    if not algorithm.dynamic_sampling:
        return {}
    pool = "batch" if ESTIMATORS[algorithm.advantage].pools == "batch" else "group"
    why: dict[int, str] = {}
    sizes = pool_sizes(returns, algorithm.advantage, baseline)
    spread = contrasted(returns, algorithm.advantage, baseline)
    for i, (size, values) in enumerate(zip(sizes, advantages, strict=True)):
        if size is None or spread[i] is not False or any(values):
            continue
        if size <= 1:
            why[i] = (
                f"no_contrast: no other session of its {pool} trained in this step (its "
                "partners were dropped or not claimed), so nothing to compare it with; "
                "algorithm.dynamic_sampling"
            )
        else:
            why[i] = (
                f"no_contrast: its returns equal its {pool}'s mean at every position (the "
                f"{pool}'s returns have no spread there), so every advantage is 0; "
                "algorithm.dynamic_sampling"
            )
    return why


def _place_rewards(session: _Session, rows: Sequence[Sample]) -> None:
    """Under ``algorithm.critic``, each trained turn's reward on its last loss token (for GAE,
    trainer/algorithm.py, which ends an episode at its row's last loss token).

    A path turn places its undiscounted return less that of the next path turn that trains in
    its row, so the last trained path turn of a row places its whole return: the rewards of
    later turns that train nothing (cut, masked) and of turns in later rows reach the row's
    tokens, as they reach its advantages without the critic. An alternative places its own
    reward. A turn that trains nothing places nothing itself."""
    path = sorted((t for t in session.turns if not t.alternative), key=lambda t: t.order)
    later: dict[int, float] = {}  # a trained path turn -> the next trained one's return, its row
    next_in_row: dict[int, float] = {}  # row -> the return of its nearest later trained turn
    for turn in reversed(path):
        if turn.trains and turn.undiscounted is not None:
            later[id(turn)] = next_in_row.get(turn.row, 0.0)
            next_in_row[turn.row] = turn.undiscounted
    for turn in session.turns:
        if not turn.trains or turn.undiscounted is None:
            continue
        row = rows[turn.row]
        last = max(i for i in range(turn.start, turn.end) if row.loss_mask[i])
        row.rewards[last] += turn.undiscounted - later.get(id(turn), 0.0)


def build_batch(
    sessions: Sequence[dict[str, Any]], rules: Rules, baseline: RunningBaseline | None
) -> Batch:
    """Samples for one training step of the policy at ``rules.policy_version``."""
    algorithm = rules.algorithm
    batch = Batch(samples=[], session_ids=[s["session_id"] for s in sessions])
    kept: list[tuple[_Session, _Masked]] = []
    for data in sessions:
        session = _session(data, algorithm)
        if session.turns:
            batch.rewards.append(session.recorded)
            batch.returns.append(session.first_return)
        reason = _drop_before_masking(session, rules)
        if reason is not None:
            tally = session.unmasked()
        else:
            masked = _mask(session, rules)
            tally = Tally(masked=masked.masked)
            if not any(turn.trains for turn in session.turns):
                reason = _nothing_to_train(masked.masked, len(session.turns), rules)
        batch.masked.update(tally.masked)
        batch.dropped_tokens += tally.dropped_tokens
        if reason is not None:
            batch.dropped[data["session_id"]] = reason
            batch.tallies[data["session_id"]] = tally
            continue
        kept.append((session, masked))
    returns = [_returns(session) for session, _ in kept]
    advantages = session_advantages(
        returns, algorithm.advantage, baseline, std=algorithm.advantage_std
    )
    no_contrast = _without_contrast(returns, advantages, rules, baseline)
    for k, ((session, masked), values) in enumerate(zip(kept, advantages, strict=True)):
        if k in no_contrast:
            tally = Tally(masked.masked, sum(row.loss_tokens for row in masked.rows))
            batch.dropped[session.data["session_id"]] = no_contrast[k]
            batch.tallies[session.data["session_id"]] = tally
            batch.dropped_tokens += tally.dropped_tokens
            continue
        batch.staleness += masked.staleness
        batch.off_policy_tokens += masked.off_policy
        trained = [t for t in session.turns if t.trains]
        for turn, advantage in zip(trained, values, strict=True):
            row = masked.rows[turn.row]
            row.advantages[turn.start : turn.end] = [advantage] * (turn.end - turn.start)
        if algorithm.critic:
            _place_rewards(session, masked.rows)
        batch.samples += [row for row in masked.rows if row.loss_tokens]
    return batch
