"""``publish.mode=disk`` checks at start that the engines read what the trainer writes.

A real ``proxrl train`` (Ray, FSDP2) attached to a real ``proxrl serve`` in front of a real
``proxrl engine``. The engine "on another machine" is one whose view of the filesystem is not
the trainer's: it runs in its own mount namespace (``unshare --mount``, root) with an empty
tmpfs over the trainer's output directory, so the path exists there and holds nothing the
trainer wrote, as on a machine without the shared filesystem. There the trainer stops at start,
before it claims anything, and says what it needs; with the engine on the same filesystem it
trains.
"""

from __future__ import annotations

import os
import sys

import pytest

from server.common.processes import ServerProcess
from tests.support import ROOT, ProxyProcess, free_port
from tests.trainer_runs import Server, finish, metrics, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Mount an empty tmpfs over $1 in this (private) mount namespace, then run the engine.
HIDE = 'mount -t tmpfs proxrl-hidden "$1" && shift && exec "$@"'


def engine(model_dir, log_dir, hidden=None) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable, "-m", "server.cli", "engine", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    if hidden is not None:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", HIDE, "sh",
                str(hidden), *argv]  # fmt: skip
    process = ServerProcess(
        argv, f"http://127.0.0.1:{port}", log_dir / f"engine-{port}.log", cwd=ROOT
    )
    process.ready_path = "/model_info"
    return process.wait_ready(180)


def test_an_engine_that_cannot_see_the_trainers_disk_stops_the_trainer_at_start(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "train"
    out.mkdir()
    hidden = engine(tiny_model_dir, tmp_path, hidden=out)  # root: a private mount namespace
    try:
        with ProxyProcess(tiny_model_dir, tmp_path / "server", "--engines", hidden.url) as proxy:
            server = Server(proxy)
            sessions = [server.episode(reward=float(i % 2)) for i in range(2)]
            trainer = start_trainer(server, out, "batch_size=2", "max_steps=1")
            code = trainer.wait(400)
            log = trainer.log_path.read_text()
            assert code == 1, log[-3000:]
            assert "publish.mode=disk needs the server and every engine to read" in log
            assert f"{hidden.url}: {out / 'weights'}" in log  # the engine and what it lacks
            assert "shared filesystem" in log and "publish.mode=distributed" in log
            assert metrics(out) == []  # stopped before anything trained
            assert {server.statuses()[s] for s in sessions} == {"trainable"}  # never claimed
    finally:
        hidden.stop()


def test_an_engine_on_the_trainers_disk_passes_the_check_and_trains(tiny_model_dir, tmp_path):
    out = tmp_path / "train"
    shared = engine(tiny_model_dir, tmp_path)
    try:
        with ProxyProcess(tiny_model_dir, tmp_path / "server", "--engines", shared.url) as proxy:
            server = Server(proxy)
            sessions = [server.episode(reward=float(i % 2)) for i in range(2)]
            log = finish(start_trainer(server, out, "batch_size=2", "max_steps=1"), 400)
            assert "publish.mode=disk: the server and 1 engine(s) read" in log
            assert [r["step"] for r in metrics(out)] == [1]
            assert {server.statuses()[s] for s in sessions} == {"consumed"}
    finally:
        shared.stop()


def test_an_engine_down_at_start_is_warned_of_and_the_trainer_trains(tiny_model_dir, tmp_path):
    """One engine of two down at start (nothing listens at its address): the probe asks only
    the engines a publish loads, so the trainer warns that the down one could not be checked
    and trains (the old probe asked it, and the trainer stopped, saying the path was not
    shared). The output_dir is given relative to the trainer's working directory: the driver
    makes it absolute once, for the probe and every publish alike."""
    out = tmp_path / "train"
    shared = engine(tiny_model_dir, tmp_path)
    down = f"http://127.0.0.1:{free_port()}"
    try:
        engines = f"{shared.url},{down}"
        with ProxyProcess(tiny_model_dir, tmp_path / "server", "--engines", engines) as proxy:
            server = Server(proxy)
            sessions = [server.episode(reward=float(i % 2)) for i in range(2)]
            relative = os.path.relpath(out, ROOT)  # the trainer runs in ROOT
            trainer = start_trainer(
                server, out, "batch_size=2", "max_steps=1", f"output_dir={relative}"
            )
            log = finish(trainer, 400)
            assert f"could not check that {down} reads {out / 'weights'}" in log
            assert "not asked" in log
            assert "publish.mode=disk: the server and 1 engine(s) read" in log
            assert [r["step"] for r in metrics(out)] == [1]
            assert {server.statuses()[s] for s in sessions} == {"consumed"}
    finally:
        shared.stop()
