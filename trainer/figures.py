"""Every figure of a training step, and the progress line: from the workers' sums to
``metrics.jsonl``, the experiment trackers (`tracking`), the server's dashboard and the log.

`combine` adds up what the workers return: their sums over micro-batches are summed over
workers, ``grad_norms`` (one per minibatch, the same on every worker) are taken once, and wall
times are the slowest worker's. So a step's figures are the same whether one worker or several
trained it. `step_record` turns those totals and the batch into the figures, by name; `Progress`
writes them and prints a line every ``log_every`` steps with rates, phase times and an ETA.

This module knows nothing about HTTP, Ray or torch.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint import TrainerState
from trainer.rollouts import ALTERNATIVE, OFF_TEMPERATURE, Batch

log = logging.getLogger("proxrl.trainer")

WALL_TIMES = ("seconds", "proximal_seconds")  # per worker; the step waits for the slowest
PER_STEP = ("grad_norms",)  # computed on the whole model: every worker holds the same values


def combine(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step's totals from each worker's ``train_step`` result."""
    totals: dict[str, Any] = {}
    for result in results:
        for key, value in result.items():
            if key in PER_STEP:
                totals.setdefault(key, value)
            elif key in WALL_TIMES:
                totals[key] = max(totals.get(key, 0.0), value)
            else:
                totals[key] = totals.get(key, 0.0) + value
    return totals


# (record key prefix, name in the progress line) of the phases the line times
PHASES_SHOWN = (
    ("claim", "claim"),
    ("proximal", "prox"),
    ("update", "update"),
    ("publish", "publish"),
    ("checkpoint", "ckpt"),
)


@dataclass(frozen=True)
class Phases:
    """Seconds the driver spent in the step's phases outside the workers' update."""

    claim: float
    publish: float
    checkpoint: float = 0.0  # 0 in a step that wrote no checkpoint


def step_record(
    state: TrainerState,
    batch: Batch,
    stats: dict[str, Any],
    phases: Phases,
    reference_kl: bool = False,
    temperature: float | None = None,
) -> dict[str, Any]:
    """Every figure of one step, as written to ``metrics.jsonl`` and posted to the server.

    ``stats`` are the step's totals (`combine`: ``loss.STAT_NAMES`` and the worker's own sums,
    ``grad_norms``, wall times); fractions and the entropy are over the step's loss tokens, the
    ratio and KL figures over the tokens the behaviour mask kept. ``reference_kl`` adds the KL
    to the reference model (trained with ``kl_coef > 0``). ``trained_share`` is the step's
    trained tokens over every token its sessions sampled (trained, masked by cause, or in a
    dropped session); the ``total_*`` figures are the run's so far, as ``state`` keeps them.
    """
    tokens = batch.loss_tokens
    tokens_all = max(stats.get("tokens", tokens), 1)
    kept = max(stats.get("kept_tokens", 0.0), 1.0)
    sampled = max(batch.sampled_tokens, 1)
    grad_norms = stats.get("grad_norms", [])
    train_s = stats.get("seconds", 0.0)
    proximal_s = stats.get("proximal_seconds", 0.0)
    advantages = [
        advantage
        for sample in batch.samples
        for advantage, in_loss in zip(sample.advantages, sample.loss_mask, strict=True)
        if in_loss
    ]
    record: dict[str, Any] = {
        "time": time.time(),
        "step": state.step,
        "version": state.version,
        "temperature": temperature,
        "sessions": batch.sessions,
        "session_ids": batch.session_ids,
        "dropped_sessions": batch.dropped_sessions,
        **{f"dropped_{code}": n for code, n in reason_codes(batch.dropped.values()).items()},
        "reward_mean": _mean(batch.rewards),  # the sessions' undiscounted outcomes
        "return_mean": _mean(batch.returns),  # their first turns' discounted returns
        **_summary("advantage", advantages),
        "trained_tokens": tokens,
        "sampled_tokens": batch.sampled_tokens,
        "trained_share": trained_share(tokens, batch.sampled_tokens),
        "masked_tokens": {cause: n for cause, n in sorted(batch.masked.items()) if n},
        "dropped_tokens": batch.dropped_tokens,
        **totals(state),
        "stale_tokens": batch.stale_tokens,
        "off_temperature_tokens": batch.masked[OFF_TEMPERATURE],
        "alternative_tokens": batch.masked[ALTERNATIVE],
        "off_policy_tokens": batch.off_policy_tokens,
        "off_temperature_masked_fraction": batch.masked[OFF_TEMPERATURE] / sampled,
        "off_policy_fraction": batch.off_policy_tokens / sampled,
        "staleness_mean": _mean(batch.staleness),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_histogram": _histogram(batch.staleness),
        "loss": stats.get("loss_sum", 0.0) / max(len(grad_norms), 1),
        "entropy": stats.get("entropy_sum", 0.0) / tokens_all,
        "clip_fraction": stats.get("clipped_tokens", 0.0) / tokens_all,
        "dual_clip_fraction": stats.get("dual_clipped_tokens", 0.0) / tokens_all,
        "ratio_mean": stats.get("ratio_sum", 0.0) / kept,
        "approx_kl": stats.get("approx_kl_sum", 0.0) / kept,
        "behaviour_over_cap_fraction": stats.get("behaviour_over_cap_tokens", 0.0) / tokens_all,
        "behaviour_masked_fraction": stats.get("behaviour_masked_tokens", 0.0) / tokens_all,
        "behaviour_weight_mean": stats.get("behaviour_weight_sum", 0.0) / tokens_all,
        "logprob_mismatch_mean": (
            stats["mismatch_sum"] / stats["mismatch_tokens"]
            if stats.get("mismatch_tokens")
            else None
        ),
        "grad_norm": _mean(grad_norms),
        "claim_seconds": phases.claim,
        "train_seconds": train_s,
        "proximal_seconds": proximal_s,
        "update_seconds": max(train_s - proximal_s, 0.0),
        "publish_seconds": phases.publish,
        "checkpoint_seconds": phases.checkpoint,
        "tokens_per_second": tokens / max(train_s + phases.publish, 1e-9),
    }
    if reference_kl:
        record["reference_kl"] = stats.get("reference_kl_sum", 0.0) / kept
    return record


def reason_codes(reasons: Iterable[str]) -> dict[str, int]:
    """Sessions dropped for each reason code (the text before the colon)."""
    counts: dict[str, int] = {}
    for reason in reasons:
        code = reason.split(":", 1)[0]
        counts[code] = counts.get(code, 0) + 1
    return counts


def trained_share(trained: int, sampled: int) -> float:
    """The share of sampled tokens that trained (1.0 when nothing was sampled)."""
    return trained / sampled if sampled else 1.0


# ----- the run's totals: what was sampled, and what of it trained ------------------------------


def add_to_totals(state: TrainerState, batch: Batch) -> None:
    """Count the batch (trained or not) in the run's totals that ``state`` keeps."""
    state.total_sampled_tokens += batch.sampled_tokens
    state.total_trained_tokens += batch.loss_tokens
    for cause, n in batch.masked.items():
        if n:
            state.total_masked_tokens[cause] = state.total_masked_tokens.get(cause, 0) + n
    for code, n in reason_codes(batch.dropped.values()).items():
        state.total_dropped_sessions[code] = state.total_dropped_sessions.get(code, 0) + n


def totals(state: TrainerState) -> dict[str, Any]:
    """The run's totals as a step's record carries them."""
    return {
        "total_sampled_tokens": state.total_sampled_tokens,
        "total_trained_tokens": state.total_trained_tokens,
        "total_trained_share": state.total_trained_share,
        "total_masked_tokens": dict(state.total_masked_tokens),
        "total_dropped_sessions": dict(state.total_dropped_sessions),
    }


def share_warning(state: TrainerState, min_share: float) -> str | None:
    """A sentence when less of what the run sampled trained than ``min_share``, naming the
    biggest causes (masked tokens by cause, dropped sessions by reason code); else None."""
    share = state.total_trained_share
    if share >= min_share:
        return None
    masked = sorted(state.total_masked_tokens.items(), key=lambda item: -item[1])
    dropped = sorted(state.total_dropped_sessions.items(), key=lambda item: -item[1])
    causes = [f"{n} tokens masked as {cause}" for cause, n in masked[:3]]
    causes += [f"{n} sessions dropped as {code}" for code, n in dropped[:3]]
    return (
        f"only {share:.0%} of the {state.total_sampled_tokens} tokens the run sampled trained "
        f"(min_trained_share {min_share:g}); the biggest causes: "
        + ("; ".join(causes) or "none counted")
    )


ETA_AFTER = 3  # step intervals measured before there is an ETA
ETA_WINDOW = 20  # the recent step intervals the ETA's pace comes from


def eta_seconds(step_ends: Sequence[float], steps_left: int) -> float | None:
    """Seconds until ``steps_left`` more steps at the recent pace: the mean interval between the
    last ``ETA_WINDOW`` + 1 step ends (monotonic seconds). None until ``ETA_AFTER`` intervals
    are measured: the first step carries the start-up (workers loading, the first sessions
    arriving), so a rate from it, or from the time since the start, says nothing of the rest."""
    if len(step_ends) <= ETA_AFTER:
        return None
    recent = list(step_ends)[-(ETA_WINDOW + 1) :]
    return (recent[-1] - recent[0]) / (len(recent) - 1) * steps_left


class Progress:
    """Every step's figures to ``metrics.jsonl``, the experiment trackers and the server; a
    line every ``log_every`` steps (and on the last) with rates, phase times and an ETA."""

    def __init__(
        self,
        max_steps: int,
        first_step: int,
        path: Path,
        log_every: int = 1,
        reference_kl: bool = False,
    ) -> None:
        self.max_steps = max_steps
        self.first_step = first_step
        self.log_every = log_every
        self.reference_kl = reference_kl
        self.step_ends: deque[float] = deque(maxlen=ETA_WINDOW + 1)  # for the ETA
        self.last: dict[str, Any] | None = None  # the last step's record
        self.path = path
        self.report: Callable[[dict[str, Any]], None] | None = None  # to the server
        self.track: Callable[[dict[str, Any]], None] | None = None  # to the experiment trackers

    def step(
        self,
        state: TrainerState,
        batch: Batch,
        stats: dict[str, Any],
        phases: Phases,
        temperature: float | None = None,
    ) -> dict[str, Any]:
        """Record the step (``temperature``: the one it trained at) and print its line."""
        record = step_record(state, batch, stats, phases, self.reference_kl, temperature)
        self.step_ends.append(time.monotonic())
        self.last = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.track is not None:
            self.track(record)
        if self.report is not None:
            self.report(record)
        if state.step % self.log_every == 0 or 0 < self.max_steps <= state.step:
            log.info("%s", self.line(record))
        for session_id, reason in batch.dropped.items():
            log.info("dropped session %s: %s", session_id, reason)
        return record

    def stopped(self) -> None:
        """Tell the server the trainer stopped cleanly, so the dashboard shows it at once: the
        last step's figures again, with ``stopped_at`` (unix seconds). Without a step this time
        there is nothing to amend."""
        if self.last is not None and self.report is not None:
            self.report({**self.last, "stopped_at": time.time()})

    def line(self, record: dict[str, Any]) -> str:
        if self.max_steps:
            eta = eta_seconds(self.step_ends, self.max_steps - record["step"])
            of, left = f"/{self.max_steps}", f"ETA {_duration(eta)}"
        else:  # no last step: it trains until it is stopped
            of, left = "", "until stopped"
        seconds = " ".join(
            f"{short} {record[f'{name}_seconds']:.2f}" for name, short in PHASES_SHOWN
        )
        dropped = f" ({record['dropped_sessions']} dropped)" if record["dropped_sessions"] else ""
        return (
            f"step {record['step']}{of} · v{record['version']} · "
            f"reward {record['reward_mean']:.3f} · {record['sessions']} sessions{dropped}, "
            f"{record['trained_tokens']} tokens (trained {record['trained_share']:.0%}, "
            f"{record['tokens_per_second']:.0f} tok/s) · "
            f"staleness {record['staleness_mean']:.2f} (max {record['staleness_max']}) · "
            f"loss {record['loss']:.4f} · entropy {record['entropy']:.3f} · "
            f"clip {record['clip_fraction']:.3f} · seconds: {seconds} · {left}"
        )


def _histogram(values: list[int]) -> list[int]:
    """Counts of 0, 1, 2, ... (versions behind)."""
    counts = [0] * (max(values, default=-1) + 1)
    for value in values:
        counts[value] += 1
    return counts


def _mean(values: Sequence[float] | Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _summary(name: str, values: list[float]) -> dict[str, float]:
    """``name``_mean, _std (population), _min and _max of ``values``; all 0 when empty."""
    mean = _mean(values)
    variance = _mean([(value - mean) ** 2 for value in values])
    return {
        f"{name}_mean": mean,
        f"{name}_std": variance**0.5,
        f"{name}_min": min(values, default=0.0),
        f"{name}_max": max(values, default=0.0),
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:  # too few steps to tell
        return f"after {ETA_AFTER + 1} steps"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
