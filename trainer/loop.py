"""The training loop: claim → recompute → advantages → update → publish → checkpoint → log.

``Trainer.run`` reads top to bottom like the recipe. Generation never waits for it: the server
keeps serving while a step trains, and new weights are swapped into the engines in place.
Each phase is a call into a module that owns it (``rollouts``, ``plan``, the workers,
``publish``, ``checkpoint``); this module only orders them and keeps the books.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.advantages import RunningBaseline
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.cluster import WorkerGroup
from trainer.config import TrainConfig, to_dict
from trainer.plan import plan_step
from trainer.publish import Publisher
from trainer.rollouts import Batch, build_batch
from trainer.server_api import ServerAPI
from trainer.worker import WorkerSettings

log = logging.getLogger("proxrl.trainer")


@dataclass
class Claimed:
    claim_ids: list[str] = field(default_factory=list)
    sessions: list[dict[str, Any]] = field(default_factory=list)


def worker_settings(config: TrainConfig, model_dir: str) -> WorkerSettings:
    algo, optim = config.algorithm, config.optim
    return WorkerSettings(
        model_dir=model_dir,
        lr=config.lr,
        weight_decay=optim.weight_decay,
        betas=(optim.beta1, optim.beta2),
        adam_eps=optim.eps,
        grad_clip=optim.grad_clip,
        warmup_steps=optim.warmup_steps,
        temperature=algo.temperature,
        decoupled=algo.decoupled,
        eps_clip=algo.eps_clip,
        eps_clip_high=algo.eps_clip_high,
        dual_clip=algo.dual_clip,
        behaviour_cap=algo.behaviour_cap if algo.decoupled else None,
        behaviour_mode=algo.behaviour_mode,
        kl_coef=algo.kl_coef,
        seed=config.seed,
        device=config.cluster.device,
        threads=config.cluster.threads_per_worker,
    )


class Trainer:
    def __init__(self, config: TrainConfig, server: ServerAPI) -> None:
        self.config = config
        self.server = server
        self.output = Path(config.output_dir)
        self.output.mkdir(parents=True, exist_ok=True)
        self.checkpoints = Checkpoints(self.output, config.keep_checkpoints)
        run = server.run(config.run_id) if config.run_id else server.default_run()
        self.run_id: str = run["id"]
        self.model_dir: str = config.model or run["model_path"]
        self.state = TrainerState(version=int(run["policy_version"]))
        self.baseline = RunningBaseline(config.algorithm.baseline_momentum)
        self.pending: list[str] = []  # claims trained on but not yet covered by a checkpoint
        self.stopping = False

    # ----- start ------------------------------------------------------------------------------

    def start(self, workers: WorkerGroup) -> None:
        """Configure the run, restore the last checkpoint, settle the claims it left behind."""
        self.workers = workers
        self.publisher = Publisher(self.config, self.server, self.run_id, workers, self.output)
        algo = self.config.algorithm
        self.server.configure_run(
            self.run_id,
            {
                "batch_size": self.config.batch_size,
                "max_staleness": self.config.max_staleness,
                "group_size": algo.group_size if algo.group_size > 1 else None,
            },
        )
        server_version = self.state.version
        found = self.checkpoints.latest()
        if found is not None:
            path, self.state = found
            workers.call("load_checkpoint", str(path))
            self.baseline.load_state_dict(self.state.baseline)
            log.info(
                "resumed from %s: step %d, version %d", path, self.state.step, self.state.version
            )
        self._settle_journal(set(self.state.covered_claims))
        if server_version != self.state.version:
            # The engines serve weights this trainer no longer has (trained after the last
            # checkpoint, or by someone else): serve the restored ones under a new version.
            self.state.version = max(server_version, self.state.version) + 1
            self.publisher.publish(self.state.version)
            log.info("republished the restored weights as version %d", self.state.version)

    def _settle_journal(self, covered: set[str]) -> None:
        for claim_id in self.checkpoints.journalled():
            if claim_id in covered:
                self.server.confirm(claim_id)
            else:
                released = self.server.release(claim_id)
                log.info(
                    "released claim %s (%d sessions) left by a stopped run", claim_id, released
                )
        self.checkpoints.clear_journal()

    # ----- the loop ---------------------------------------------------------------------------

    def run(self) -> TrainerState:
        config = self.config
        progress = Progress(
            config.max_steps,
            self.state.step,
            self.output / "metrics.jsonl",
            log_every=config.log_every,
            reference_kl=config.algorithm.kl_coef > 0,
        )
        progress.report = lambda record: self.server.post_step(
            self.run_id, record["step"], record["version"], record
        )
        while self.state.step < config.max_steps and not self.stopping:
            started = time.monotonic()
            claimed = self.claim()  # 1. a batch of trainable sessions, exactly once
            if claimed is None:
                break
            claim_s = time.monotonic() - started
            batch = build_batch(  # 3. advantages; stale tokens masked or sessions dropped
                claimed.sessions,
                policy_version=self.state.version,
                max_staleness=config.max_staleness,
                stale=config.algorithm.stale,
                estimator=config.algorithm.advantage,
                discount=config.algorithm.discount,
                baseline=self.baseline,
            )
            stats = self.train(batch)  # 2 + 4 + 5. proximal logprobs, PPO minibatches
            self.state.version += 1
            publish_s = self.publisher.publish(self.state.version)  # 6. engines swap
            self.state.step += 1
            self.pending += claimed.claim_ids
            checkpoint_s = self.checkpoint_if_due()  # 7. model, optimizer, what was consumed
            phases = Phases(claim_s, publish=publish_s, checkpoint=checkpoint_s)
            progress.step(self.state, batch, stats, phases)  # 8. log
        if self.pending:
            self.checkpoint()
        return self.state

    def claim(self) -> Claimed | None:
        """``batch_size`` trainable sessions (whole groups), waiting as long as it takes."""
        config = self.config
        claimed = Claimed()
        waited_since = time.monotonic()
        last_note = 0.0
        while len(claimed.sessions) < config.batch_size:
            if self.stopping:
                for claim_id in claimed.claim_ids:  # untrained: back to the pool
                    self.server.release(claim_id)
                return None
            result = self.server.claim(
                self.run_id,
                config.batch_size - len(claimed.sessions),
                config.claim_lease_s,
                config.algorithm.group_size,
            )
            if result["sessions"]:
                self.checkpoints.journal_claim(result["claim_id"], self.state.step)
                claimed.claim_ids.append(result["claim_id"])
                claimed.sessions += result["sessions"]
                continue
            waited = time.monotonic() - waited_since
            if waited - last_note >= 30:
                last_note = waited
                log.info(
                    "waiting for trainable sessions: %d of %d (%.0fs)",
                    len(claimed.sessions),
                    config.batch_size,
                    waited,
                )
            time.sleep(config.claim_wait_s)
        return claimed

    def train(self, batch: Batch) -> dict[str, float]:
        if not batch.samples:
            return {}
        plan = plan_step(
            batch.samples,
            self.config.world_size,
            self.config.algorithm.ppo_minibatches,
            self.config.algorithm.max_tokens_per_microbatch,
        )
        per_rank = [(minibatches, plan.tokens) for minibatches in plan.per_rank]
        results = self.workers.call_each("train_step", per_rank)
        totals: dict[str, float] = {}
        for result in results:
            for key, value in result.items():
                totals[key] = totals.get(key, 0.0) + value
        totals["grad_norm_sum"] = results[0].get("grad_norm_sum", 0.0)  # the same on every rank
        for key in ("seconds", "proximal_seconds"):  # wall time: the slowest rank's
            totals[key] = max(r.get(key, 0.0) for r in results)
        return totals

    def checkpoint_if_due(self) -> float:
        """Checkpoint every ``checkpoint_every`` steps and at the last; the seconds it took."""
        step = self.state.step
        if step % self.config.checkpoint_every and step != self.config.max_steps:
            return 0.0
        started = time.monotonic()
        self.checkpoint()
        return time.monotonic() - started

    def checkpoint(self) -> None:
        path = self.checkpoints.path(self.state.step)
        self.workers.call("save_checkpoint", str(path))
        self.state.baseline = self.baseline.state_dict()
        self.state.covered_claims = list(self.pending)
        self.checkpoints.commit(path, self.state)
        for claim_id in self.pending:
            if self.server.confirm(claim_id) == 0:
                log.warning("claim %s had expired before it was confirmed", claim_id)
        self.pending = []
        self.checkpoints.clear_journal()

    def request_stop(self, *_: object) -> None:
        if self.stopping:
            raise KeyboardInterrupt
        log.info("stopping after this step (Ctrl-C again to stop now)")
        self.stopping = True


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
    stats: dict[str, float],
    phases: Phases,
    reference_kl: bool = False,
) -> dict[str, Any]:
    """Every figure of one step, as written to ``metrics.jsonl`` and posted to the server.

    ``stats`` are the workers' sums (``loss.STAT_NAMES`` and the worker's own, summed over
    micro-batches and ranks); fractions and the entropy are over the step's loss tokens, the
    ratio and KL figures over the tokens the behaviour mask kept. ``reference_kl`` adds the KL
    to the reference model (trained with ``kl_coef > 0``).
    """
    tokens = batch.loss_tokens
    tokens_all = max(stats.get("tokens", tokens), 1)
    kept = max(stats.get("kept_tokens", 0.0), 1.0)
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
        "sessions": batch.sessions,
        "session_ids": batch.session_ids,
        "dropped_sessions": batch.dropped_sessions,
        "reward_mean": _mean(batch.rewards),
        **_summary("advantage", advantages),
        "trained_tokens": tokens,
        "stale_tokens": batch.stale_tokens,
        "staleness_mean": _mean(batch.staleness),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_histogram": _histogram(batch.staleness),
        "loss": stats.get("loss_sum", 0.0) / max(stats.get("optimizer_steps", 1.0), 1.0),
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
        "grad_norm": stats.get("grad_norm_sum", 0.0),
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


class Progress:
    """Every step's figures to ``metrics.jsonl`` and the server; a line every ``log_every``
    steps (and on the last) with rates, phase times and an ETA."""

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
        self.started = time.monotonic()
        self.path = path
        self.report: Callable[[dict[str, Any]], None] | None = None

    def step(
        self, state: TrainerState, batch: Batch, stats: dict[str, float], phases: Phases
    ) -> dict[str, Any]:
        record = step_record(state, batch, stats, phases, self.reference_kl)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.report is not None:
            self.report(record)
        if state.step % self.log_every == 0 or state.step >= self.max_steps:
            log.info("%s", self.line(record))
        return record

    def line(self, record: dict[str, Any]) -> str:
        elapsed = time.monotonic() - self.started
        done = record["step"] - self.first_step
        eta = elapsed / done * (self.max_steps - record["step"]) if done else float("nan")
        seconds = " ".join(
            f"{short} {record[f'{name}_seconds']:.2f}" for name, short in PHASES_SHOWN
        )
        return (
            f"step {record['step']}/{self.max_steps} · v{record['version']} · "
            f"reward {record['reward_mean']:.3f} · {record['sessions']} sessions, "
            f"{record['trained_tokens']} tokens ({record['tokens_per_second']:.0f} tok/s) · "
            f"staleness {record['staleness_mean']:.2f} (max {record['staleness_max']}) · "
            f"loss {record['loss']:.4f} · entropy {record['entropy']:.3f} · "
            f"clip {record['clip_fraction']:.3f} · seconds: {seconds} · ETA {_duration(eta)}"
        )


def _histogram(values: list[int]) -> list[int]:
    """Counts of 0, 1, 2, ... (versions behind)."""
    counts = [0] * (max(values, default=-1) + 1)
    for value in values:
        counts[value] += 1
    return counts


def _mean(values: list[float] | list[int]) -> float:
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


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: no step finished yet
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def install_signal_handlers(trainer: Trainer) -> None:
    signal.signal(signal.SIGINT, trainer.request_stop)
    signal.signal(signal.SIGTERM, trainer.request_stop)


def describe_start(config: TrainConfig, trainer: Trainer) -> str:
    return (
        f"training run {trainer.run_id} from version {trainer.state.version} "
        f"({config.world_size} worker(s), batch {config.batch_size}, "
        f"max staleness {config.max_staleness}); config: {json.dumps(to_dict(config))}"
    )
