"""Every step's figures to the experiment trackers users already watch: TensorBoard always,
Weights & Biases and MLflow when the config names them.

`scalars` turns a step's record (`figures.step_record`, the row of ``metrics.jsonl``) into named
scalars, grouped by what they measure (`NAMES`); `Tracking` sends them to each configured
tracker at the step's number, with the run's config (secrets left out) once, when the tracker's
run is made. Each tracker is one small class behind one interface (`Tracker`), and one entry in
`TRACKERS`.

Restarts: the trainer resumes from its last checkpoint and trains the steps after it again.
``<output_dir>/tracking.json`` keeps each tracker's run id and the last step it holds, so a
resumed trainer writes into the same W&B and MLflow runs. TensorBoard can take steps back
(``purge_step``): the replayed steps replace the lost ones. W&B and MLflow cannot, so they keep
the steps they already hold and take the run up again after them; no step is written twice.

Each tracker sends from a thread of its own (`Lane`), so a slow or unreachable one never holds
a step: training only queues the figures. A tracker that fails (network, disk) never stops
training either: the failure is logged once, the tracker is left alone for `RETRY_AFTER_S` and
then tried again. Starting is done before the first step, every tracker at once in a thread of
its own (W&B and MLflow create or find their run there); one that has not started after
`START_WAIT_S` (a tracking server that never answers: MLflow alone retries for minutes) is
left behind, and training goes on without it. A tracker configured but not installed is a
`ConfigError` at start (`check_installed`). This module knows nothing about the server, Ray or
the training itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainer.config import ConfigError, TrackingConfig

log = logging.getLogger("proxrl.trainer")

RETRY_AFTER_S = 60.0  # a tracker that failed is left alone this long, then tried again
QUEUED_STEPS = 1000  # steps a slow tracker may fall behind before steps are left out
CLOSE_WAIT_S = 60.0  # at the end, how long the trackers get to send what is queued
START_WAIT_S = 60.0  # at the start, how long the trackers get to make or find their runs
STATE_FILE = "tracking.json"

# figure in the step's record -> its name in the trackers, grouped by what it measures
NAMES = {
    "reward_mean": "reward/mean",
    "return_mean": "reward/return_mean",
    "advantage_mean": "advantage/mean",
    "advantage_std": "advantage/std",
    "advantage_min": "advantage/min",
    "advantage_max": "advantage/max",
    "loss": "loss/value",
    "grad_norm": "loss/grad_norm",
    "entropy": "policy/entropy",
    "approx_kl": "policy/approx_kl",
    "reference_kl": "policy/reference_kl",
    "ratio_mean": "policy/ratio_mean",
    "clip_fraction": "policy/clip_fraction",
    "dual_clip_fraction": "policy/dual_clip_fraction",
    "clipped_sequences": "policy/clipped_sequences",
    "second_moment_masked_fraction": "behaviour/second_moment_masked_fraction",
    "value_loss": "critic/value_loss",
    "value_clip_fraction": "critic/clip_fraction",
    "value_mean": "critic/value_mean",
    "value_target_mean": "critic/target_mean",
    "behaviour_weight_mean": "behaviour/weight_mean",
    "behaviour_over_cap_fraction": "behaviour/over_cap_fraction",
    "behaviour_masked_fraction": "behaviour/masked_fraction",
    "logprob_mismatch_mean": "behaviour/logprob_mismatch_mean",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "sessions": "sessions/claimed",
    "dropped_sessions": "sessions/dropped",
    "trained_tokens": "tokens/trained",
    "sampled_tokens": "tokens/sampled",
    "dropped_tokens": "tokens/dropped",
    "trained_share": "tokens/trained_share",
    "total_sampled_tokens": "run/sampled_tokens",
    "total_trained_tokens": "run/trained_tokens",
    "total_trained_share": "run/trained_share",
    "stale_tokens": "tokens/stale",
    "off_policy_tokens": "tokens/off_policy",
    "off_temperature_tokens": "tokens/off_temperature",
    "alternative_tokens": "tokens/alternative",
    "off_policy_fraction": "tokens/off_policy_fraction",
    "off_temperature_masked_fraction": "tokens/off_temperature_masked_fraction",
    "tokens_per_second": "throughput/tokens_per_second",
    "claim_seconds": "time/claim",
    "train_seconds": "time/train",
    "proximal_seconds": "time/proximal",
    "update_seconds": "time/update",
    "publish_seconds": "time/publish",
    "checkpoint_seconds": "time/checkpoint",
    "version": "run/policy_version",
    "temperature": "run/temperature",
}
DROPPED = "dropped_"  # dropped_<reason code>: sessions/dropped_<reason code>
# figures that are counts by name -> the group of their scalars, one per name
COUNTS = {
    "masked_tokens": "masked",  # masked/<cause>: the step's masked tokens
    "total_masked_tokens": "masked_total",  # masked_total/<cause>: the run's so far
    "total_dropped_sessions": "dropped_total",  # dropped_total/<reason code>: the run's
}
NOT_SCALARS = ("time", "step")  # the step's wall time and number: where, not what


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric figures by their tracker names (`NAMES`), and its counts by name
    one scalar per name (`COUNTS`). Lists (session ids, the staleness histogram) and figures
    with no value this step (null) are not scalars; a figure `NAMES` does not know yet goes
    under ``other/``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in COUNTS and isinstance(value, dict):
            out.update({f"{COUNTS[key]}/{name}": float(n) for name, n in value.items()})
        if key in NOT_SCALARS or not _is_number(value):
            continue
        out[tracker_name(key)] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def tracker_name(key: str) -> str:
    if key in NAMES:
        return NAMES[key]
    if key.startswith(DROPPED):
        return "sessions/" + key
    return "other/" + key


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """``{"algorithm": {"eps_clip": 0.2}}`` → ``{"algorithm.eps_clip": 0.2}``; null and lists as
    text, as hyperparameter tables want plain values."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, (str, int, float, bool)):
            out[prefix + key] = value
        else:
            out[prefix + key] = json.dumps(value)
    return out


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run when it starts."""

    run_id: str  # the proxrl run
    output_dir: Path
    config: dict[str, Any]  # the trainer's config as plain data, secrets left out
    first_step: int  # the first step this trainer writes (1 + the checkpoint's)


class Tracker(Protocol):
    """One experiment tracker. ``open`` gets what it kept last time (``{}`` the first time) and
    returns what to keep (its run id); it logs the config when it makes a new run."""

    name: str
    rewinds: bool  # takes the steps a restart replays (others keep the steps they hold)

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]: ...

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"
    rewinds = True

    def __init__(self, config: TrackingConfig) -> None:
        self.directory = config.tensorboard_dir
        self.writer: Any = None

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        directory = self.directory or str(run.output_dir / "tensorboard")
        # purge_step: TensorBoard hides what an earlier start wrote from this step on
        self.writer = SummaryWriter(directory, purge_step=run.first_step)
        if not kept.get("config_logged"):
            config = flat(run.config)
            self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=2) + "\n```")
            for summary in hparams(config, {NAMES["reward_mean"]: 0.0}):
                self.writer.file_writer.add_summary(summary)
        self.writer.flush()
        return {"directory": directory, "config_logged": True}

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=wall_time)
        self.writer.flush()  # a step's figures are on disk when the next step starts

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    name = "wandb"
    rewinds = False

    def __init__(self, config: TrackingConfig) -> None:
        self.config = config.wandb
        self.run: Any = None

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        import wandb

        run_id = kept.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.config.name or run.run_id,
            id=run_id,
            resume="allow",
            mode=self.config.mode,
            tags=list(self.config.tags) or None,
            config=run.config if not kept else None,
            dir=os.environ.get("WANDB_DIR", str(run.output_dir)),
            # no console capture, no metadata (it holds the command line, which may carry
            # admin_key=...): the admin key never leaves this machine
            settings=wandb.Settings(
                console="off", x_disable_meta=True, disable_git=True, save_code=False
            ),
        )
        return {"id": run_id}

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            wandb.teardown()  # waits for W&B's service to write (or send) all it was given


class MlflowTracker:
    name = "mlflow"
    rewinds = False

    def __init__(self, config: TrackingConfig) -> None:
        self.config = config.mlflow
        self.client: Any = None
        self.run_id = ""

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.config.tracking_uri)
        if kept.get("run_id"):
            self.run_id = kept["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return kept
        experiment = self.client.get_experiment_by_name(self.config.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.config.experiment)
        )
        created = self.client.create_run(
            experiment_id,
            run_name=self.config.run_name or run.run_id,
            tags={"proxrl.run_id": run.run_id},
        )
        self.run_id = created.info.run_id
        params = [Param(key, str(value)) for key, value in flat(run.config).items()]
        self.client.log_batch(self.run_id, params=params)
        return {"run_id": self.run_id}

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        millis = int(wall_time * 1000)
        metrics = [Metric(name, value, millis, step) for name, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, "FINISHED")


@dataclass(frozen=True)
class TrackerSpec:
    make: Callable[[TrackingConfig], Tracker]
    enabled: Callable[[TrackingConfig], bool]
    package: str  # what `check_installed` looks for
    setting: str  # the setting that turns it on, named in errors
    extra: str  # pip install 'proxrl[<extra>]'


TRACKERS: dict[str, TrackerSpec] = {
    "tensorboard": TrackerSpec(
        TensorBoardTracker, lambda c: c.tensorboard, "tensorboard", "tracking.tensorboard", ""
    ),
    "wandb": TrackerSpec(
        WandbTracker, lambda c: bool(c.wandb.project), "wandb", "tracking.wandb.project", "wandb"
    ),
    "mlflow": TrackerSpec(
        MlflowTracker,
        lambda c: bool(c.mlflow.tracking_uri),
        "mlflow",
        "tracking.mlflow.tracking_uri",
        "mlflow",
    ),
}


def check_installed(config: TrackingConfig) -> None:
    """Every configured tracker can be imported (checked at start, before anything runs)."""
    for spec in TRACKERS.values():
        if spec.enabled(config) and importlib.util.find_spec(spec.package) is None:
            how = f"pip install 'proxrl[{spec.extra}]'" if spec.extra else "reinstall proxrl"
            raise ConfigError(spec.setting, f"the {spec.package} package is not installed: {how}")


class Lane:
    """One tracker's own thread: the steps queue up and it sends them in order, so a slow or
    hanging tracker holds neither training nor the other trackers."""

    def __init__(self, tracker: Tracker, after: int, sent: Callable[[str, int], None]) -> None:
        self.tracker = tracker
        self.after = after  # the last step the tracker holds already
        self.sent = sent  # told each step the tracker took
        self.queue: queue.Queue[tuple[int, dict[str, float], float] | None] = queue.Queue(
            QUEUED_STEPS
        )
        self.failed_at: float | None = None
        self.warned = False
        self.thread = threading.Thread(
            target=self._send, name=f"tracking-{tracker.name}", daemon=True
        )
        self.thread.start()

    def put(self, step: int, values: dict[str, float], wall_time: float) -> None:
        if step <= self.after:
            return
        try:
            self.queue.put_nowait((step, values, wall_time))
        except queue.Full:
            self.failed(RuntimeError(f"{QUEUED_STEPS} steps wait to be sent; step {step} is not"))

    def _send(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:  # the end: closing is done here too, so it cannot hang it
                    self._close_tracker()
                    return
                step, values, wall_time = item
                if self.resting():
                    continue  # this step is not sent
                try:
                    self.tracker.log(step, values, wall_time)
                except Exception as exc:
                    self.failed(exc)
                    continue
                if self.failed_at is not None:
                    self.failed_at = None
                    log.info("%s: logging again from step %d", self.tracker.name, step)
                self.sent(self.tracker.name, step)
            finally:
                self.queue.task_done()

    def resting(self) -> bool:
        """Left alone after a failure (for `RETRY_AFTER_S`)."""
        return self.failed_at is not None and time.monotonic() - self.failed_at < RETRY_AFTER_S

    def close(self, deadline: float) -> None:
        """Send what is queued and close the tracker, in its thread, until ``deadline`` (a
        monotonic time); after that the thread is left behind."""
        name = self.tracker.name
        with contextlib.suppress(queue.Full):  # full: the thread is stuck, the join says so
            self.queue.put(None, timeout=max(deadline - time.monotonic(), 0.01))
        self.thread.join(max(deadline - time.monotonic(), 0.01))
        if self.thread.is_alive():
            log.warning(
                "%s: still sending or closing at the end; what it has not sent is lost", name
            )

    def _close_tracker(self) -> None:
        try:
            self.tracker.close()
        except Exception as exc:
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        self.failed_at = time.monotonic()
        if self.warned:
            return
        self.warned = True
        log.warning(
            "%s failed (%s: %s); training goes on, and it is tried again every %.0f s "
            "(this is said once)",
            self.tracker.name,
            type(exc).__name__,
            exc,
            RETRY_AFTER_S,
        )


class Tracking:
    """The configured trackers, each in a `Lane` of its own, shielded from the others and from
    training."""

    def __init__(self, trackers: list[Tracker], run: RunInfo) -> None:
        self.run = run
        self.path = run.output_dir / STATE_FILE
        self.lock = threading.Lock()  # the lanes report the steps they sent from their threads
        self.state = self._load_state()
        self.state_warned = False
        self.lanes: list[Lane] = []
        opened = self._open(trackers)
        for tracker in trackers:
            entry = self.state.setdefault(tracker.name, {})
            if tracker.name not in opened:
                continue
            entry["kept"] = opened[tracker.name]
            if tracker.rewinds or "last_step" not in entry:
                entry["last_step"] = run.first_step - 1
            elif entry["last_step"] >= run.first_step:
                log.info(
                    "%s holds steps %d-%d from before the restart; it goes on from step %d",
                    tracker.name,
                    run.first_step,
                    entry["last_step"],
                    entry["last_step"] + 1,
                )
            self.lanes.append(Lane(tracker, entry["last_step"], self._sent))
        with self.lock:
            self._save_state()

    def _open(self, trackers: list[Tracker]) -> dict[str, dict[str, Any]]:
        """What each tracker that started keeps. All start at once, each in a thread of its own;
        one not started by `START_WAIT_S` is left behind (said, never raised), and closed if it
        starts later."""
        opened: dict[str, dict[str, Any]] = {}
        left_behind: set[str] = set()
        lock = threading.Lock()

        def start(tracker: Tracker, kept: dict[str, Any]) -> None:
            try:
                made = tracker.open(self.run, kept)
            except Exception as exc:
                log.warning(
                    "%s: could not start (%s: %s); training goes on without it",
                    tracker.name,
                    type(exc).__name__,
                    exc,
                )
                return
            with lock:
                late = tracker.name in left_behind
                if not late:
                    opened[tracker.name] = made
            if late:
                with contextlib.suppress(Exception):
                    tracker.close()

        threads = [
            threading.Thread(
                target=start,
                args=(tracker, self.state.get(tracker.name, {}).get("kept", {})),
                name=f"tracking-start-{tracker.name}",
                daemon=True,
            )
            for tracker in trackers
        ]
        deadline = time.monotonic() + START_WAIT_S
        for thread in threads:
            thread.start()
        for tracker, thread in zip(trackers, threads, strict=True):
            thread.join(max(deadline - time.monotonic(), 0.0))
            with lock:
                if tracker.name in opened or not thread.is_alive():
                    continue
                left_behind.add(tracker.name)
            log.warning(
                "%s: not started after %.1f s; training goes on without it",
                tracker.name,
                START_WAIT_S,
            )
        with lock:
            return dict(opened)

    @classmethod
    def start(cls, config: TrackingConfig, run: RunInfo) -> Tracking:
        trackers = [spec.make(config) for spec in TRACKERS.values() if spec.enabled(config)]
        return cls(trackers, run)

    @property
    def trackers(self) -> list[str]:
        return [lane.tracker.name for lane in self.lanes]

    def log(self, record: dict[str, Any]) -> None:
        """Queue the step's figures for every tracker that does not hold the step yet."""
        values = scalars(record)
        wall_time = float(record.get("time", time.time()))
        for lane in self.lanes:
            lane.put(int(record["step"]), values, wall_time)

    def flush(self) -> None:
        """Wait until every tracker has taken (or given up on) every step queued so far."""
        for lane in self.lanes:
            lane.queue.join()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        for lane in self.lanes:
            lane.close(deadline)
        self.lanes = []

    def _sent(self, name: str, step: int) -> None:
        with self.lock:
            self.state[name]["last_step"] = step
            self._save_state()

    def _load_state(self) -> dict[str, Any]:
        """What the trackers kept, if this output directory was this run's (else a fresh
        start: another run's tracker runs are not taken over)."""
        if not self.path.exists():
            return {}
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s); the trackers start new runs", self.path, exc)
            return {}
        if saved.get("run_id") != self.run.run_id:
            return {}
        trackers: dict[str, Any] = saved.get("trackers", {})
        return trackers

    def _save_state(self) -> None:
        text = json.dumps({"run_id": self.run.run_id, "trackers": self.state}, indent=1)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self.state_warned:
                self.state_warned = True
                log.warning("could not write %s (%s); a restart starts new runs", self.path, exc)
