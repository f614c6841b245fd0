"""Claimed sessions → training samples, or a reason why a session cannot be one.

The server sends each claimed session as rows (``input_ids``, ``loss_mask``, behaviour
``logprobs``, per-token ``versions``) whose turns carry their span, reward, sampling temperature
and whether the session continued them (``alternative``). This module decides, per session:

- **dropped, with a reason** (never an exception: bad data must not stop the trainer): no turns;
  a row longer than the per-row limit; under ``stale=drop`` a token too stale; or nothing left
  to train once tokens are masked. The reason reaches the server at confirm time;
- **masked tokens, counted by cause**: tokens more than ``max_staleness`` updates behind
  (`staleness.versions_behind`); turns sampled at another temperature than the training one
  under ``off_temperature=mask``; alternatives without a reward of their own;
- **off-policy tokens**: under ``off_temperature=off_policy`` a turn sampled at another
  temperature keeps its stored logprob as the behaviour logprob (the distribution it was really
  drawn from) and a greedy turn gets 0 (log 1: greedy decoding is deterministic);
- **advantages**: discounted returns along the session's path, a rewarded alternative's own
  reward, then the run's estimator (`advantages`) over the returns of the turns that train.

Pure: it knows nothing about HTTP, Ray or torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.advantages import RunningBaseline, SessionReturns, session_advantages, turn_returns
from trainer.config import AlgorithmConfig
from trainer.staleness import Republish, versions_behind

PROMPT_VERSION = -1  # the store's version for tokens that no policy sampled
GREEDY_BELOW = 1e-6  # a sampling temperature below this is greedy decoding (as in SGLang)
SAME_TEMPERATURE = 1e-6  # temperatures this close are the same distribution

# Why loss tokens were masked out: the keys of Batch.masked.
STALE, OFF_TEMPERATURE, ALTERNATIVE = "stale", "off_temperature", "alternative"


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

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Batch:
    samples: list[Sample]
    session_ids: list[str]  # every claimed session, trained or dropped
    dropped: dict[str, str] = field(default_factory=dict)  # session id -> why
    rewards: list[float] = field(default_factory=list)  # per session with turns: its path's G_0
    staleness: list[int] = field(default_factory=list)  # updates behind, per trained token
    masked: Counter[str] = field(default_factory=Counter)  # loss tokens masked, by cause
    off_policy_tokens: int = 0  # off-temperature tokens trained with their own behaviour logprob

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
    trains: bool = False  # any loss token left after masking
    advantage: float = 0.0


def _turns(session: dict[str, Any]) -> list[_Turn]:
    turns: list[_Turn] = []
    for r, row in enumerate(session["rows"]):
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
                )
            )
    return turns


def _path(turns: list[_Turn]) -> list[_Turn]:
    return sorted((t for t in turns if not t.alternative), key=lambda t: t.order)


# --- why a session cannot train -------------------------------------------------------------


def _drop_before_masking(session: dict[str, Any], turns: list[_Turn], rules: Rules) -> str | None:
    if not turns:
        return "no_turns: the session has no model call to train on"
    limit = rules.row_limit
    longest = max(len(row["input_ids"]) for row in session["rows"])
    if limit is not None and longest > limit:
        return (
            f"row_too_long: a row of {longest} tokens, more than {rules.row_limit_name} ({limit})"
        )
    if rules.algorithm.stale == "drop":
        sampled = [v for row in session["rows"] for v in row["versions"] if v != PROMPT_VERSION]
        lag = max((rules.behind(v) for v in sampled), default=0)
        if lag > rules.max_staleness:
            return (
                f"stale: tokens sampled {lag} updates before the trained policy, more than "
                f"max_staleness ({rules.max_staleness}); algorithm.stale=drop"
            )
    return None


def _nothing_to_train(masked: Counter[str], empty: int, rules: Rules) -> str:
    parts = []
    if masked[OFF_TEMPERATURE]:
        parts.append(
            f"{masked[OFF_TEMPERATURE]} sampled at another temperature than the run's "
            f"{rules.temperature:g} (off_temperature=mask)"
        )
    if masked[STALE]:
        parts.append(f"{masked[STALE]} more than max_staleness ({rules.max_staleness}) behind")
    if masked[ALTERNATIVE]:
        parts.append(f"{masked[ALTERNATIVE]} in alternatives the session did not continue")
    if not parts:
        return f"no_trainable_tokens: its {empty} turn(s) sampled no token"
    return "no_trainable_tokens: every sampled token was masked: " + ", ".join(parts)


# --- masking --------------------------------------------------------------------------------


def _temperature_rule(temperature: float | None, rules: Rules) -> str:
    """ "on" (the training distribution), "mask" or "off_policy"."""
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
    )


@dataclass
class _Masked:
    rows: list[Sample]
    masked: Counter[str] = field(default_factory=Counter)
    staleness: list[int] = field(default_factory=list)
    off_policy: int = 0


def _mask(session: dict[str, Any], turns: list[_Turn], rules: Rules) -> _Masked:
    """The session's rows with every mask applied; marks which turns still train."""
    out = _Masked([_sample(session["session_id"], row) for row in session["rows"]])
    for turn in turns:
        row = out.rows[turn.row]
        rule = _temperature_rule(turn.temperature, rules)
        no_return = turn.alternative and turn.reward is None
        for i in range(turn.start, turn.end):
            if not row.loss_mask[i]:
                continue
            cause = None
            if no_return:
                cause = ALTERNATIVE
            elif rule == "mask":
                cause = OFF_TEMPERATURE
            elif rules.behind(row.versions[i]) > rules.max_staleness:
                cause = STALE
            if cause is not None:
                row.loss_mask[i] = 0
                out.masked[cause] += 1
                continue
            turn.trains = True
            out.staleness.append(rules.behind(row.versions[i]))
            if rule == "off_policy":
                out.off_policy += 1
                if turn.temperature is not None and turn.temperature < GREEDY_BELOW:
                    row.behaviour[i] = 0.0
            else:
                row.fresh[i] = int(row.versions[i] == rules.policy_version)
    return out


# --- the batch ------------------------------------------------------------------------------


def _returns(session: dict[str, Any], turns: list[_Turn], discount: float) -> dict[int, float]:
    """The return of every turn that has one, by its position in ``turns``."""
    path = sorted(
        (i for i, t in enumerate(turns) if not t.alternative), key=lambda i: turns[i].order
    )
    rewards = [turns[i].reward for i in path]
    out = dict(zip(path, turn_returns(rewards, session.get("reward"), discount), strict=True))
    for i, turn in enumerate(turns):
        if turn.alternative and turn.reward is not None:
            out[i] = float(turn.reward)
    return out


def _first_return(session: dict[str, Any], turns: list[_Turn], discount: float) -> float:
    path = _path(turns)
    returns = turn_returns([t.reward for t in path], session.get("reward"), discount)
    return returns[0] if returns else 0.0


def build_batch(
    sessions: Sequence[dict[str, Any]], rules: Rules, baseline: RunningBaseline | None
) -> Batch:
    """Samples for one training step of the policy at ``rules.policy_version``."""
    algorithm = rules.algorithm
    batch = Batch(samples=[], session_ids=[s["session_id"] for s in sessions])
    kept: list[tuple[dict[str, Any], list[_Turn], _Masked, dict[int, float]]] = []
    for session in sessions:
        turns = _turns(session)
        if turns:
            batch.rewards.append(_first_return(session, turns, algorithm.discount))
        reason = _drop_before_masking(session, turns, rules)
        if reason is not None:
            batch.dropped[session["session_id"]] = reason
            continue
        masked = _mask(session, turns, rules)
        batch.masked.update(masked.masked)
        if not any(turn.trains for turn in turns):
            reason = _nothing_to_train(masked.masked, len(turns), rules)
            batch.dropped[session["session_id"]] = reason
            continue
        batch.staleness += masked.staleness
        batch.off_policy_tokens += masked.off_policy
        returns = _returns(session, turns, algorithm.discount)
        kept.append((session, turns, masked, returns))
    trained = [
        [i for i, turn in enumerate(turns) if turn.trains and i in returns]
        for _, turns, _, returns in kept
    ]
    advantages = session_advantages(
        [
            SessionReturns(
                group_key=session.get("group_id"),
                task_key=session.get("task_id"),
                returns=[returns[i] for i in indices],
            )
            for (session, _, _, returns), indices in zip(kept, trained, strict=True)
        ],
        algorithm.advantage,
        baseline,
    )
    for (_, turns, masked, _), indices, values in zip(kept, trained, advantages, strict=True):
        for i, advantage in zip(indices, values, strict=True):
            turn = turns[i]
            row = masked.rows[turn.row]
            row.advantages[turn.start : turn.end] = [advantage] * (turn.end - turn.start)
        batch.samples += [row for row in masked.rows if row.loss_tokens]
    return batch
