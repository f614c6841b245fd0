"""Claimed sessions → training samples: rows with per-token advantages and staleness applied.

The server sends each claimed session as rows (``input_ids``, ``loss_mask``, behaviour
``logprobs``, per-token ``versions``) whose turns carry their span and reward. This module
turns rewards into per-turn advantages (``advantages``), spreads each turn's advantage over its
tokens, and masks or drops tokens sampled more than ``max_staleness`` versions before the
policy being trained. Pure: it knows nothing about HTTP, Ray or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.advantages import RunningBaseline, SessionReturns, session_advantages, turn_returns

PROMPT_VERSION = -1  # the store's version for tokens that no policy sampled


@dataclass
class Sample:
    """One training row."""

    session_id: str
    input_ids: list[int]
    loss_mask: list[int]
    behaviour: list[float]  # the engine's logprob of each token (0 on prompt tokens)
    versions: list[int]  # the policy version that sampled each token (-1 on prompt tokens)
    advantages: list[float] = field(default_factory=list)
    # 1 on loss tokens sampled by the very policy the step starts from (staleness 0): there the
    # engine's and the trainer's logprobs should agree, so their gap measures the mismatch.
    fresh: list[int] = field(default_factory=list)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Batch:
    samples: list[Sample]
    sessions: int  # sessions claimed
    dropped_sessions: int  # dropped for staleness
    stale_tokens: int  # masked for staleness
    rewards: list[float]  # one per session (its first-turn return)
    staleness: list[int]  # versions behind, per trained token
    session_ids: list[str]  # every claimed session, trained or dropped

    @property
    def loss_tokens(self) -> int:
        return sum(s.loss_tokens for s in self.samples)


def _turns(session: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(row position, turn) for every turn of the session, in order."""
    return [(i, turn) for i, row in enumerate(session["rows"]) for turn in row["turns"]]


def build_batch(
    sessions: Sequence[dict[str, Any]],
    *,
    policy_version: int,
    max_staleness: int,
    stale: Literal["mask", "drop"],
    estimator: str,
    discount: float,
    baseline: RunningBaseline | None,
) -> Batch:
    """Samples for one training step of the policy at ``policy_version``."""
    oldest = policy_version - max_staleness
    kept: list[dict[str, Any]] = []
    dropped = 0
    for session in sessions:
        versions = [v for row in session["rows"] for v in row["versions"] if v != PROMPT_VERSION]
        if stale == "drop" and versions and min(versions) < oldest:
            dropped += 1
        else:
            kept.append(session)
    returns = [
        SessionReturns(
            group_key=session.get("group_id"),
            task_key=session.get("task_id"),
            returns=turn_returns(
                [turn.get("reward") for _, turn in _turns(session)],
                session.get("reward"),
                discount,
            ),
        )
        for session in kept
    ]
    advantages = session_advantages(returns, estimator, baseline)  # type: ignore[arg-type]
    samples: list[Sample] = []
    stale_tokens = 0
    staleness: list[int] = []
    for session, per_turn in zip(kept, advantages, strict=True):
        rows = [_sample(session["session_id"], row) for row in session["rows"]]
        for (position, turn), advantage in zip(_turns(session), per_turn, strict=True):
            row = rows[position]
            for i in range(turn["start"], turn["end"]):
                row.advantages[i] = advantage
        for row in rows:
            row.fresh = [0] * len(row.versions)
            for i, version in enumerate(row.versions):
                if not row.loss_mask[i]:
                    continue
                if version < oldest:
                    row.loss_mask[i] = 0
                    stale_tokens += 1
                else:
                    staleness.append(max(0, policy_version - version))
                    row.fresh[i] = int(version == policy_version)
            if row.loss_tokens:
                samples.append(row)
    return Batch(
        samples=samples,
        sessions=len(sessions),
        dropped_sessions=dropped,
        stale_tokens=stale_tokens,
        rewards=[r.returns[0] if r.returns else 0.0 for r in returns],
        staleness=staleness,
        session_ids=[session["session_id"] for session in sessions],
    )


def _sample(session_id: str, row: dict[str, Any]) -> Sample:
    return Sample(
        session_id=session_id,
        input_ids=list(row["input_ids"]),
        loss_mask=list(row["loss_mask"]),
        behaviour=list(row["logprobs"]),
        versions=list(row["versions"]),
        advantages=[0.0] * len(row["input_ids"]),
    )
