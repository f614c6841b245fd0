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
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.common.trained_share import share_warning as trained_share_warning
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
    to the reference model (trained with ``kl_coef > 0``). What of the sampled tokens trained
    is `share_figures`.
    """
    tokens = batch.loss_tokens  # what the update processed, behaviour-masked tokens included
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
        **_summary("advantage", _trained_advantages(batch)),
        **share_figures(state, batch, stats),
        **_masking_figures(batch),
        "staleness_mean": _mean(batch.staleness),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_histogram": _histogram(batch.staleness),
        **_update_figures(stats, tokens, reference_kl),
        **_time_figures(stats, phases),
        # the update's pace: over the tokens it processed, those the loss masked included
        "tokens_per_second": tokens / max(stats.get("seconds", 0.0) + phases.publish, 1e-9),
    }
    return record


def share_figures(state: TrainerState, batch: Batch, stats: dict[str, Any]) -> dict[str, Any]:
    """What of the step's sampled tokens trained: ``trained_share`` is its trained tokens over
    every token its sessions sampled (trained, masked by cause, or in a dropped session); the
    loss's behaviour-cap masking (`BEHAVIOUR_CAP`) is a cause like the batch's own. The
    ``total_*`` figures are the run's so far, as ``state`` keeps them."""
    trained = trained_tokens(batch, stats)
    return {
        "trained_tokens": trained,
        "sampled_tokens": batch.sampled_tokens,
        "trained_share": trained_share(trained, batch.sampled_tokens),
        "masked_tokens": masked_tokens(batch, stats),
        "dropped_tokens": batch.dropped_tokens,
        **totals(state),
    }


def _masking_figures(batch: Batch) -> dict[str, Any]:
    """The batch's masked and off-policy tokens, as counts and shares of what it sampled."""
    sampled = max(batch.sampled_tokens, 1)
    return {
        "stale_tokens": batch.stale_tokens,
        "off_temperature_tokens": batch.masked[OFF_TEMPERATURE],
        "alternative_tokens": batch.masked[ALTERNATIVE],
        "off_policy_tokens": batch.off_policy_tokens,
        "off_temperature_masked_fraction": batch.masked[OFF_TEMPERATURE] / sampled,
        "off_policy_fraction": batch.off_policy_tokens / sampled,
    }


def _update_figures(stats: dict[str, Any], tokens: int, reference_kl: bool) -> dict[str, Any]:
    """The loss, the policy's and the behaviour weight's figures from the workers' sums."""
    tokens_all = max(stats.get("tokens", tokens), 1)
    kept = max(stats.get("kept_tokens", 0.0), 1.0)
    grad_norms = stats.get("grad_norms", [])
    figures = {
        "loss": stats.get("loss_sum", 0.0) / max(len(grad_norms), 1),
        "entropy": stats.get("entropy_sum", 0.0) / tokens_all,
        "clip_fraction": stats.get("clipped_tokens", 0.0) / tokens_all,
        "dual_clip_fraction": stats.get("dual_clipped_tokens", 0.0) / tokens_all,
        # gspo clips whole rows: how many rows with loss tokens had their sequence ratio clipped
        "clipped_sequences": stats.get("clipped_sequences", 0.0),
        # m2po: the share of loss tokens masked to bound the second moment of the log ratio
        "second_moment_masked_fraction": (
            stats.get("second_moment_masked_tokens", 0.0) / tokens_all
        ),
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
    }
    if reference_kl:
        figures["reference_kl"] = stats.get("reference_kl_sum", 0.0) / kept
    if "value_loss_sum" in stats:  # the critic's, per loss token
        figures |= {
            "value_loss": stats["value_loss_sum"] / tokens_all,
            "value_clip_fraction": stats.get("value_clipped_tokens", 0.0) / tokens_all,
            "value_mean": stats.get("value_sum", 0.0) / tokens_all,
            "value_target_mean": stats.get("return_sum", 0.0) / tokens_all,
        }
    return figures


def _time_figures(stats: dict[str, Any], phases: Phases) -> dict[str, float]:
    train_s = stats.get("seconds", 0.0)
    proximal_s = stats.get("proximal_seconds", 0.0)
    return {
        "claim_seconds": phases.claim,
        "train_seconds": train_s,
        "proximal_seconds": proximal_s,
        "update_seconds": max(train_s - proximal_s, 0.0),
        "publish_seconds": phases.publish,
        "checkpoint_seconds": phases.checkpoint,
    }


def _trained_advantages(batch: Batch) -> list[float]:
    return [
        advantage
        for sample in batch.samples
        for advantage, in_loss in zip(sample.advantages, sample.loss_mask, strict=True)
        if in_loss
    ]


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

# The masked cause the loss decides: under stale=keep, a token whose behaviour weight
# pi_prox / pi_behav is above algorithm.behaviour_cap with behaviour_mode token_mask or
# sequence_mask leaves the loss (the workers count it: ``behaviour_masked_tokens``).
BEHAVIOUR_CAP = "behaviour_cap"


def behaviour_masked(stats: dict[str, Any] | None) -> int:
    """Loss tokens the update masked above the behaviour cap (none without an update)."""
    return round((stats or {}).get("behaviour_masked_tokens", 0))


def trained_tokens(batch: Batch, stats: dict[str, Any] | None) -> int:
    """The batch's loss tokens that trained: those the loss did not mask."""
    return batch.loss_tokens - behaviour_masked(stats)


def masked_tokens(batch: Batch, stats: dict[str, Any] | None) -> dict[str, int]:
    """Masked tokens by cause: the batch's, and the loss's `BEHAVIOUR_CAP`; none of 0."""
    masked = Counter(batch.masked)
    masked[BEHAVIOUR_CAP] += behaviour_masked(stats)
    return {cause: n for cause, n in sorted(masked.items()) if n}


def add_to_totals(state: TrainerState, batch: Batch, stats: dict[str, Any] | None) -> None:
    """Count the batch in the run's totals that ``state`` keeps: after its update (``stats``,
    which say what the loss masked), or with ``stats`` None when it trained nothing."""
    state.total_sampled_tokens += batch.sampled_tokens
    state.total_trained_tokens += trained_tokens(batch, stats)
    add_counts(state.total_masked_tokens, masked_tokens(batch, stats))
    add_counts(state.total_dropped_sessions, reason_codes(batch.dropped.values()))


def add_counts(totals: dict[str, int], counts: Mapping[str, int]) -> None:
    for key, n in counts.items():
        if n:
            totals[key] = totals.get(key, 0) + n


def drop_tally(batch: Batch, session_ids: Iterable[str]) -> dict[str, Any]:
    """What the dropped sessions among ``session_ids`` sampled, as the claim journal keeps it:
    tokens masked by cause, tokens dropped with them, and sessions by reason code."""
    dropped = [s for s in session_ids if s in batch.dropped]
    masked: dict[str, int] = {}
    for session_id in dropped:
        add_counts(masked, batch.tallies[session_id].masked)
    return {
        "dropped_tokens": sum(batch.tallies[s].dropped_tokens for s in dropped),
        "masked_tokens": masked,
        "dropped_sessions": reason_codes(batch.dropped[s] for s in dropped),
    }


def add_tally(state: TrainerState, tally: dict[str, Any]) -> None:
    """Count a `drop_tally` in the run's totals (a restart's, for drops no checkpoint holds)."""
    state.total_sampled_tokens += tally["dropped_tokens"] + sum(tally["masked_tokens"].values())
    add_counts(state.total_masked_tokens, tally["masked_tokens"])
    add_counts(state.total_dropped_sessions, tally["dropped_sessions"])


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
    """The run's low-share warning (`server.common.trained_share`) from its totals so far."""
    return trained_share_warning(
        state.total_trained_share,
        state.total_sampled_tokens,
        state.total_masked_tokens,
        state.total_dropped_sessions,
        min_share,
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

    def amend_totals(self, state: TrainerState) -> None:
        """After a batch that trained nothing (no step, so no record of its own): the last
        step's record again, with the run's totals now, so that the server's view of the run
        counts it (the same step and version: the server keeps it as that step). Not written
        to ``metrics.jsonl`` or the trackers, which hold that step already. Without a step
        this time there is nothing to amend."""
        if self.last is None:
            return
        self.last = {**self.last, **totals(state)}
        if self.report is not None:
            self.report(self.last)

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
