"""Experiment tracking (trainer/tracking.py), read back from what each tracker wrote.

The step records are real ones (`figures.step_record`). TensorBoard's event files are read with
TensorBoard's own `EventAccumulator`; the W&B run, written in offline mode, is read from its
``run-<id>.wandb`` log with W&B's own record type (W&B 0.31 no longer ships a Python reader of
that log, so `wandb_history` walks its blocks: the LevelDB log layout, every record's CRC
checked); MLflow's metrics come back through `MlflowClient.get_metric_history`, from a ``file:``
store and from a SQLite one. Nothing leaves the machine.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import tracking
from trainer.checkpoint import TrainerState
from trainer.config import (
    ConfigError,
    MlflowConfig,
    TrackingConfig,
    WandbConfig,
    load_config,
    to_dict,
)
from trainer.figures import Phases, add_to_totals, step_record
from trainer.rollouts import ALTERNATIVE, OFF_TEMPERATURE, STALE, Batch, Sample
from trainer.tracking import (
    NAMES,
    RunInfo,
    TensorBoardTracker,
    Tracking,
    check_installed,
    scalars,
)

ADMIN_KEY = "sk-admin-never-leaves-4b1d9e"
RUN_ID = "run-tracked"


def record(step: int, shift: float = 0.0) -> dict[str, Any]:
    """A real step record whose every figure is present (reference KL, a drop, a logprob
    mismatch, a temperature) and moves with ``step`` (and ``shift``: a replayed step)."""
    samples = [
        Sample("a", [1] * 4, [0, 1, 1, 1], [0.0] * 4, [0, 0, 0, 1], [0.0, 0.5, 0.5, -0.25 * step]),
        Sample("b", [1] * 3, [0, 1, 1], [0.0] * 3, [0, 1, 1], [0.0, -1.0, 0.125 * step]),
    ]
    batch = Batch(
        samples=samples,
        rewards=[0.1 * step + shift, 0.5],
        staleness=[0, 1, step % 3],
        session_ids=["a", "b", "c"],
        dropped={"c": "stale: sampled by version 0"},
        masked=Counter({STALE: step, OFF_TEMPERATURE: 1, ALTERNATIVE: 2}),
        off_policy_tokens=1,
    )
    stats = {
        "loss_sum": 0.3 * step + shift,
        "entropy_sum": 2.0 + step,
        "clipped_tokens": 1.0,
        "dual_clipped_tokens": 0.0,
        "ratio_sum": 4.5,
        "approx_kl_sum": 0.01 * step,
        "reference_kl_sum": 0.02 * step,
        "behaviour_over_cap_tokens": 1.0,
        "behaviour_masked_tokens": 1.0,
        "behaviour_weight_sum": 4.0,
        "kept_tokens": 4.0,
        "mismatch_sum": 0.05,
        "mismatch_tokens": 5,
        "grad_norms": [0.5 * step, 0.25],
        "seconds": 1.5,
        "proximal_seconds": 0.5,
    }
    state = TrainerState(run_id=RUN_ID, step=step, version=step + 1)
    state.total_masked_tokens = {ALTERNATIVE: 2 * step - 2, STALE: 10}  # the run's before it
    state.total_dropped_sessions = {"stale": step - 1}
    add_to_totals(state, batch, stats)
    phases = Phases(claim=0.25, publish=0.125, checkpoint=0.0 if step % 2 else 0.5)
    return step_record(state, batch, stats, phases, reference_kl=True, temperature=0.9)


def run_info(out: Path, first_step: int = 1) -> RunInfo:
    config = load_config(None, ["model=/models/tiny", f"admin_key={ADMIN_KEY}", "lr=3e-4"])
    return RunInfo(RUN_ID, out, to_dict(config, omit_secrets=True), first_step)


# ----- reading back ------------------------------------------------------------------------


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def as_float32(value: float) -> float:
    return float(np.float32(value))  # TensorBoard keeps scalars as float32


def wandb_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` log: a 7-byte header, then 32 KiB blocks of chunks, each
    ``crc32(type + data)``, length, type (1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        assert crc == zlib.crc32(bytes([kind]) + chunk)
        pending += chunk
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(pending)
            records.append(parsed)
            pending = b""
    return records


def wandb_history(wandb_dir: Path) -> tuple[dict[int, dict[str, float]], set[str], list[Any]]:
    """Step -> figures over every offline run directory, the run ids, the run records."""
    history: dict[int, dict[str, float]] = {}
    ids, runs = set(), []
    for log_path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(log_path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                runs.append(rec.run)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                step = rec.history.step.num
                assert step not in history, f"step {step} written twice"
                history[step] = {
                    k: json.loads(v) for k, v in items.items() if not k.startswith("_")
                }
    return history, ids, runs


def mlflow_history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
        for name in client.get_run(run_id).data.metrics
    }


@pytest.fixture
def quiet_wandb(tmp_path, monkeypatch):
    """W&B offline, all its files under tmp_path: nothing is sent, nothing lands in ~."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
        (tmp_path / "wandb-home" / name.lower()).mkdir(parents=True)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "wandb-home" / "wandb_dir"


# MLflow's SQLite store uses a loader SQLAlchemy 2.1 deprecates (a warning, not our code's)
SQLITE = pytest.param(
    "sqlite", marks=pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")
)


@pytest.fixture(params=["file", SQLITE])
def mlflow_uri(request, tmp_path, monkeypatch):
    """A local MLflow store; MLflow 3 refuses ``file:`` stores unless told otherwise."""
    if request.param == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        return (tmp_path / "mlruns").as_uri()
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


# ----- names -------------------------------------------------------------------------------


def test_every_numeric_figure_has_a_name_of_its_group():
    figures = record(3)
    numeric = {
        k
        for k, v in figures.items()
        if isinstance(v, (int, float)) and k not in tracking.NOT_SCALARS
    }
    counts = {f"{tracking.COUNTS[k]}/{name}" for k in tracking.COUNTS for name in figures[k]}
    named = scalars(figures)
    assert len(named) == len(numeric) + len(counts)  # one scalar each, no two on one name
    assert counts <= set(named)
    assert not [name for name in named if name.startswith("other/")]  # NAMES knows them all
    assert named["reward/mean"] == figures["reward_mean"]
    assert named["sessions/dropped_stale"] == 1
    assert named["policy/reference_kl"] == figures["reference_kl"]
    assert all(name.count("/") == 1 for name in named)
    assert len(set(NAMES.values())) == len(NAMES)
    # lists and missing figures are not scalars; a figure NAMES does not know still goes out
    assert scalars({"step": 1, "time": 2.0, "session_ids": ["a"], "temperature": None}) == {}
    assert scalars({"new_figure": 2}) == {"other/new_figure": 2.0}


def test_masked_tokens_by_cause_and_the_run_s_totals_are_scalars_by_name():
    figures = record(3)
    named = scalars(figures)
    assert figures["masked_tokens"] == {
        "alternative": 2,
        "behaviour_cap": 1,
        "off_temperature": 1,
        "stale": 3,
    }
    assert named["masked/stale"] == 3 and named["masked/behaviour_cap"] == 1
    assert named["masked_total/alternative"] == 2 * 3 - 2 + 2 and named["masked_total/stale"] == 13
    assert named["dropped_total/stale"] == 3 - 1 + 1
    assert named["tokens/trained_share"] == figures["trained_share"]
    assert named["run/trained_share"] == figures["total_trained_share"]
    assert "masked/greedy" not in named  # a cause without tokens is no figure


# ----- TensorBoard -------------------------------------------------------------------------


def test_tensorboard_holds_every_figure_at_every_step(tmp_path):
    steps = [record(step) for step in range(1, 5)]
    tracked = Tracking.start(TrackingConfig(), run_info(tmp_path))
    for figures in steps:
        tracked.log(figures)
    tracked.close()

    written = tensorboard_scalars(tmp_path / "tensorboard")
    want = [scalars(figures) for figures in steps]
    assert set(written) == set(want[0])
    for name, points in written.items():
        assert points == [(s, as_float32(w[name])) for s, w in enumerate(want, start=1)], name
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert any("config" in tag for tag in events.Tags()["tensors"])  # the config, as text
    saved = json.loads((tmp_path / "tracking.json").read_text())
    assert saved["trackers"]["tensorboard"]["last_step"] == 4


def test_tensorboard_dir_and_switch(tmp_path):
    where = tmp_path / "elsewhere"
    tracked = Tracking.start(TrackingConfig(tensorboard_dir=str(where)), run_info(tmp_path))
    tracked.log(record(1))
    tracked.close()
    assert tensorboard_scalars(where)["reward/mean"] == [(1, as_float32(record(1)["reward_mean"]))]

    off = Tracking.start(TrackingConfig(tensorboard=False), run_info(tmp_path / "off"))
    off.log(record(1))
    off.close()
    assert not (tmp_path / "off" / "tensorboard").exists()


# ----- W&B and MLflow ----------------------------------------------------------------------


def test_wandb_offline_run_holds_every_figure_and_the_config(tmp_path, quiet_wandb):
    config = TrackingConfig(
        tensorboard=False,
        wandb=WandbConfig(project="proxrl-tests", name="tracked", mode="offline", tags=("t1",)),
    )
    steps = [record(step) for step in range(1, 4)]
    tracked = Tracking.start(config, run_info(tmp_path))
    for figures in steps:
        tracked.log(figures)
    tracked.close()

    history, ids, runs = wandb_history(quiet_wandb)
    assert history == {s: scalars(figures) for s, figures in enumerate(steps, start=1)}
    assert ids == {
        json.loads((tmp_path / "tracking.json").read_text())["trackers"]["wandb"]["kept"]["id"]
    }
    (run,) = runs
    assert (run.project, run.display_name, list(run.tags)) == ("proxrl-tests", "tracked", ["t1"])
    logged = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert logged["lr"] == 3e-4
    assert logged["algorithm"]["eps_clip"] == 0.2
    assert "admin_key" not in logged


def test_mlflow_store_holds_every_figure_and_the_config(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    config = TrackingConfig(
        tensorboard=False,
        mlflow=MlflowConfig(tracking_uri=mlflow_uri, experiment="proxrl-tests"),
    )
    steps = [record(step) for step in range(1, 4)]
    tracked = Tracking.start(config, run_info(tmp_path))
    for figures in steps:
        tracked.log(figures)
    tracked.close()

    run_id = json.loads((tmp_path / "tracking.json").read_text())["trackers"]["mlflow"]["kept"]
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(run_id["run_id"])
    assert (run.info.run_name, run.info.status) == (RUN_ID, "FINISHED")
    assert run.data.params["lr"] == "0.0003"
    assert run.data.params["algorithm.eps_clip"] == "0.2"
    assert run.data.params["model"] == "/models/tiny"
    assert "admin_key" not in run.data.params
    written = mlflow_history(mlflow_uri, run_id["run_id"])
    want = [scalars(figures) for figures in steps]
    assert set(written) == set(want[0])
    for name, points in written.items():
        assert sorted(points) == [(s, w[name]) for s, w in enumerate(want, start=1)], name


# ----- restarts, secrets, failures ---------------------------------------------------------


def test_a_resumed_trainer_writes_into_the_same_runs_each_step_once(
    tmp_path, quiet_wandb, mlflow_uri, monkeypatch
):
    """Run 1 logs steps 1-4 and dies; its checkpoint was step 2, so run 2 trains steps 3-6
    again. TensorBoard takes the replayed 3 and 4; W&B and MLflow keep theirs; all go on."""
    monkeypatch.setattr(sys, "argv", ["proxrl", "train", f"admin_key={ADMIN_KEY}"])
    monkeypatch.setenv("PROXRL_ADMIN_KEY", ADMIN_KEY)
    config = TrackingConfig(
        wandb=WandbConfig(project="proxrl-tests", mode="offline"),
        mlflow=MlflowConfig(tracking_uri=mlflow_uri),
    )
    first = Tracking.start(config, run_info(tmp_path))
    for step in range(1, 5):
        first.log(record(step))
    first.close()  # (a killed trainer closes nothing: TensorBoard is flushed every step)
    kept = json.loads((tmp_path / "tracking.json").read_text())["trackers"]

    second = Tracking.start(config, run_info(tmp_path, first_step=3))
    for step in range(3, 7):
        second.log(record(step, shift=10.0))
    second.close()
    again = json.loads((tmp_path / "tracking.json").read_text())["trackers"]
    assert again["wandb"]["kept"] == kept["wandb"]["kept"]
    assert again["mlflow"]["kept"] == kept["mlflow"]["kept"]

    lineage = [record(1), record(2)] + [record(s, shift=10.0) for s in range(3, 7)]
    board = tensorboard_scalars(tmp_path / "tensorboard")
    assert board["reward/mean"] == [
        (s, as_float32(r["reward_mean"])) for s, r in enumerate(lineage, start=1)
    ]
    assert board["loss/value"] == [(s, as_float32(r["loss"])) for s, r in enumerate(lineage, 1)]

    first_writes = [record(s) for s in range(1, 5)] + [record(s, 10.0) for s in (5, 6)]
    history, ids, _ = wandb_history(quiet_wandb)
    assert ids == {kept["wandb"]["kept"]["id"]}
    assert {s: h["reward/mean"] for s, h in history.items()} == {
        s: r["reward_mean"] for s, r in enumerate(first_writes, start=1)
    }
    flow = mlflow_history(mlflow_uri, kept["mlflow"]["kept"]["run_id"])
    assert sorted(flow["reward/mean"]) == [
        (s, r["reward_mean"]) for s, r in enumerate(first_writes, start=1)
    ]

    leaked = [
        path
        for path in tmp_path.rglob("*")
        if path.is_file() and ADMIN_KEY.encode() in path.read_bytes()
    ]
    assert leaked == []
    assert sum(1 for _ in tmp_path.rglob("*") if _.is_file()) > 10  # they did write


class Flaky:
    """A tracker of our own protocol that fails its first ``failures`` calls to log."""

    name = "flaky"
    rewinds = False

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.logged: list[int] = []

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        return {}

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("disk full")
        self.logged.append(step)

    def close(self) -> None:
        raise ConnectionError("gone")


def test_a_failing_tracker_never_stops_the_steps(tmp_path, caplog, monkeypatch):
    flaky = Flaky(failures=3)
    tracked = Tracking([flaky, TensorBoardTracker(TrackingConfig())], run_info(tmp_path))
    with caplog.at_level(logging.WARNING, "proxrl.trainer"):
        for step in (1, 2):  # fails at 1, then rests: step 2 is not tried
            tracked.log(record(step))
        tracked.flush()
        monkeypatch.setattr(tracking, "RETRY_AFTER_S", 0.0)
        for step in (3, 4, 5, 6):  # fails at 3 and 4, works again from 5
            tracked.log(record(step))
        tracked.close()
    assert flaky.logged == [5, 6]
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"]] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flaky failed (OSError: disk full)" in warnings[0]


class Hanging:
    """A tracker of our own protocol whose calls to log wait until it is let go."""

    name = "hanging"
    rewinds = False

    def __init__(self) -> None:
        self.let_go = threading.Event()
        self.logged: list[int] = []

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        return {}

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self.let_go.wait(30)
        self.logged.append(step)

    def close(self) -> None:
        pass


def test_a_hanging_tracker_holds_neither_the_steps_nor_the_others(tmp_path, caplog):
    hanging = Hanging()
    tracked = Tracking([hanging, TensorBoardTracker(TrackingConfig())], run_info(tmp_path))
    started = time.monotonic()
    for step in range(1, 6):
        tracked.log(record(step))
    assert time.monotonic() - started < 5  # the steps only queue their figures
    steps = []
    while len(steps) < 5 and time.monotonic() - started < 30:  # TensorBoard goes on meanwhile
        time.sleep(0.1)
        steps = [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"]]
    assert steps == [1, 2, 3, 4, 5]
    assert hanging.logged == []

    with caplog.at_level(logging.WARNING, "proxrl.trainer"):
        tracked.close(wait_s=0.5)  # at the end it gets a while, then is left behind
    assert any("hanging: still sending" in r.getMessage() for r in caplog.records)
    hanging.let_go.set()


class SlowToClose(Hanging):
    """A tracker of our own protocol whose close waits until it is let go (a run that keeps
    uploading at the end)."""

    name = "slow_close"

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self.logged.append(step)

    def close(self) -> None:
        self.let_go.wait(30)


def test_a_tracker_slow_to_close_holds_the_end_no_longer_than_the_wait(tmp_path, caplog):
    slow = SlowToClose()
    tracked = Tracking([slow, TensorBoardTracker(TrackingConfig())], run_info(tmp_path))
    tracked.log(record(1))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "proxrl.trainer"):
        tracked.close(wait_s=0.5)
    assert time.monotonic() - started < 5  # not the 30 s its close would take
    slow.let_go.set()
    assert slow.logged == [1]
    assert any("slow_close: still sending" in r.getMessage() for r in caplog.records)
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"]] == [1]


class SlowToStart(Hanging):
    """A tracker of our own protocol whose start waits until it is let go (a tracking server
    that takes the connection and never answers)."""

    name = "slow"

    def open(self, run: RunInfo, kept: dict[str, Any]) -> dict[str, Any]:
        self.let_go.wait(30)
        return {}


def test_a_tracker_slow_to_start_does_not_hold_training(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(tracking, "START_WAIT_S", 0.5)
    slow = SlowToStart()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "proxrl.trainer"):
        tracked = Tracking([slow, TensorBoardTracker(TrackingConfig())], run_info(tmp_path))
    assert time.monotonic() - started < 5  # not the 30 s its start would take
    assert tracked.trackers == ["tensorboard"]
    assert any("slow: not started after 0.5 s" in r.getMessage() for r in caplog.records)
    tracked.log(record(1))
    tracked.close()
    slow.let_go.set()
    assert slow.logged == []
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"]] == [1]


def test_an_unreachable_tracking_server_is_skipped_at_start(tmp_path, caplog, monkeypatch):
    """A real refused connection: MLflow cannot start, TensorBoard still takes every step."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = TrackingConfig(mlflow=MlflowConfig(tracking_uri=f"http://127.0.0.1:{port}"))
    with caplog.at_level(logging.WARNING, "proxrl.trainer"):
        tracked = Tracking.start(config, run_info(tmp_path))
        assert tracked.trackers == ["tensorboard"]
        tracked.log(record(1))
        tracked.close()
    assert any("mlflow: could not start" in r.getMessage() for r in caplog.records)
    assert tensorboard_scalars(tmp_path / "tensorboard")["reward/mean"] == [
        (1, as_float32(record(1)["reward_mean"]))
    ]


# ----- configuration -----------------------------------------------------------------------


def test_tracking_settings_are_checked_at_start(monkeypatch):
    config = load_config(
        None,
        [
            "model=m",
            "tracking.wandb.project=p",
            "tracking.wandb.tags=[a, b]",
            "tracking.mlflow.tracking_uri=sqlite:///m.db",
        ],
    )
    assert config.tracking.wandb.tags == ("a", "b")
    for overrides, field in [
        (["tracking.wandb.name=n"], "tracking.wandb.name"),
        (["tracking.mlflow.experiment=e"], "tracking.mlflow.experiment"),
        (["tracking.tensorboard=false", "tracking.tensorboard_dir=d"], "tracking.tensorboard_dir"),
        (["tracking.wandb.project=p", "tracking.wandb.mode=live"], "tracking.wandb.mode"),
        (["tracking.wandb.project=p", "tracking.wandb.tags=3"], "tracking.wandb.tags"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_config(None, ["model=m", *overrides])
        assert caught.value.field_name == field

    check_installed(config.tracking)  # all three are installed here
    spec = tracking.TRACKERS["wandb"]
    missing = tracking.TrackerSpec(
        spec.make, spec.enabled, "proxrl_no_such_package", spec.setting, "wandb"
    )
    monkeypatch.setitem(tracking.TRACKERS, "wandb", missing)
    with pytest.raises(ConfigError, match=r"pip install 'proxrl\[wandb\]'") as caught:
        check_installed(config.tracking)
    assert caught.value.field_name == "tracking.wandb.project"
