"""The training loop: claim → recompute → advantages → update → publish → log → checkpoint.

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
        progress = Progress(config.max_steps, self.state.step, self.output / "metrics.jsonl")
        progress.report = lambda record: self.server.post_step(
            self.run_id, record["step"], record["version"], record
        )
        while self.state.step < config.max_steps and not self.stopping:
            claimed = self.claim()  # 1. a batch of trainable sessions, exactly once
            if claimed is None:
                break
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
            progress.step(self.state, batch, stats, publish_s)  # 7. log
            if (
                self.state.step % config.checkpoint_every == 0
                or self.state.step == config.max_steps
            ):
                self.checkpoint()  # 8. model, optimizer, version, what was consumed
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
        totals["seconds"] = max(r.get("seconds", 0.0) for r in results)
        return totals

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


class Progress:
    """One line per step with rates and an ETA, and every step's figures in ``metrics.jsonl``."""

    def __init__(self, max_steps: int, first_step: int, path: Path) -> None:
        self.max_steps = max_steps
        self.first_step = first_step
        self.started = time.monotonic()
        self.path = path
        self.report: Callable[[dict[str, Any]], None] | None = None

    def step(
        self, state: TrainerState, batch: Batch, stats: dict[str, float], publish_s: float
    ) -> None:
        elapsed = time.monotonic() - self.started
        done = state.step - self.first_step
        eta = elapsed / done * (self.max_steps - state.step) if done else float("nan")
        tokens = batch.loss_tokens
        tokens_all = max(stats.get("tokens", tokens), 1)
        record = {
            "time": time.time(),
            "step": state.step,
            "version": state.version,
            "sessions": batch.sessions,
            "session_ids": batch.session_ids,
            "dropped_sessions": batch.dropped_sessions,
            "reward_mean": _mean(batch.rewards),
            "trained_tokens": tokens,
            "stale_tokens": batch.stale_tokens,
            "staleness_mean": _mean(batch.staleness),
            "staleness_max": max(batch.staleness, default=0),
            "staleness_histogram": _histogram(batch.staleness),
            "loss": stats.get("loss_sum", 0.0) / max(stats.get("optimizer_steps", 1.0), 1.0),
            "clip_fraction": stats.get("clipped_tokens", 0.0) / tokens_all,
            "behaviour_masked_fraction": stats.get("behaviour_masked_tokens", 0.0) / tokens_all,
            "behaviour_weight_mean": stats.get("behaviour_weight_sum", 0.0) / tokens_all,
            "grad_norm": stats.get("grad_norm_sum", 0.0),
            "train_seconds": stats.get("seconds", 0.0),
            "publish_seconds": publish_s,
            "tokens_per_second": tokens / max(stats.get("seconds", 0.0) + publish_s, 1e-9),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.report is not None:
            self.report(record)
        log.info(
            "step %d/%d · v%d · reward %.3f · %d sessions, %d tokens (%.0f tok/s) · "
            "staleness %.2f (max %d) · clip %.3f · train %.1fs, publish %.2fs · ETA %s",
            state.step,
            self.max_steps,
            state.version,
            record["reward_mean"],
            batch.sessions,
            tokens,
            record["tokens_per_second"],
            record["staleness_mean"],
            record["staleness_max"],
            record["clip_fraction"],
            record["train_seconds"],
            publish_s,
            _duration(eta),
        )


def _histogram(values: list[int]) -> list[int]:
    """Counts of 0, 1, 2, ... (versions behind)."""
    counts = [0] * (max(values, default=-1) + 1)
    for value in values:
        counts[value] += 1
    return counts


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


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
