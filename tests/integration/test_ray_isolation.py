"""The trainer's local Ray is closed to the network and ends with the trainer.

A real ``proxrl train`` runs against a real ``proxrl serve``. Every process it started (GCS,
raylet, agents, autoscaler monitor, the workers, the trainer itself) listens on loopback only,
and once the trainer is gone, by SIGKILL or by SIGTERM, no Ray process and no Ray temporary
directory is left a few seconds later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import (
    ROOT,
    ProxyProcess,
    command_of,
    descendants,
    is_loopback_address,
    kill_all,
    listening,
    running,
)
from trainer.cluster import MARKER
from trainer.watchdog import run_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GONE_WITHIN_S = 10.0  # from the trainer's death to no Ray process and no temp dir
RAY_PARTS = ("gcs_server", "raylet", "monitor.py", "ray::Worker", "trainer/watchdog.py")


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("ray-isolation")) as process:
        yield process


class Trainer:
    """``proxrl train`` against ``proxy``, its Ray up (its workers are ready)."""

    def __init__(self, proxy: ProxyProcess, out: Path) -> None:
        self.log_path = out / "trainer.log"
        command = [
            sys.executable, "-m", "server.cli", "train", "--server", proxy.url,
            f"output_dir={out}", "batch_size=4", "claim_wait_s=0.2", "cluster.cpus_per_worker=1",
        ]  # fmt: skip
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PROXRL_ADMIN_KEY": proxy.ADMIN_KEY, "HF_HUB_OFFLINE": "1"},
            )
        self.wait_for("worker(s) ready", 300)
        self.children = descendants(self.process.pid)
        watchdogs = [p for p in self.children if "trainer/watchdog.py" in command_of(p)]
        assert len(watchdogs) == 1, [command_of(p) for p in self.children]
        self.temp_dir = Path(command_of(watchdogs[0]).split()[-2])  # MARKER DIR PID
        assert self.temp_dir.name.startswith("proxrl-ray-") and self.temp_dir.is_dir()

    def wait_for(self, line: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while line not in self.log_path.read_text():
            assert self.process.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, f"no {line!r} in {timeout_s} s\n{self.log_tail()}"
            time.sleep(0.3)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]

    def ray_processes(self) -> list[int]:
        """Every process with the run's marker in its environment (what Ray started)."""
        return run_processes(f"{MARKER}={self.temp_dir}".encode(), str(self.temp_dir))

    def seconds_until_gone(self, died_at: float) -> float:
        """Seconds from ``died_at`` until no process of the trainer's and no temp dir is left
        (fails past ``GONE_WITHIN_S``)."""
        while True:
            left = [p for p in self.children if running(p)] + self.ray_processes()
            if not left and not self.temp_dir.exists():
                return time.monotonic() - died_at
            if time.monotonic() - died_at > GONE_WITHIN_S:
                left_dir = f"; {self.temp_dir} is still there" if self.temp_dir.exists() else ""
                pytest.fail(f"left running: {[command_of(p) for p in set(left)]}{left_dir}")
            time.sleep(0.1)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        kill_all(self.children + self.ray_processes())  # a failed test leaves nothing behind


@pytest.fixture
def trainer(proxy, tmp_path):
    started = Trainer(proxy, tmp_path)
    yield started
    started.cleanup()


def test_every_process_of_the_trainer_listens_on_loopback_only(trainer):
    commands = " ".join(command_of(pid) for pid in trainer.children)
    for part in RAY_PARTS:
        assert part in commands, f"{part} is not running: {commands}"
    sockets = {}
    for _ in range(2):  # twice, a second apart: a late agent's port is counted too
        for pid in [trainer.process.pid, *trainer.children]:
            for address, port in listening(pid):
                sockets[(address, port)] = command_of(pid)[:80]
        time.sleep(1)
    # GCS, raylet (node and object managers), the runtime-env agent, the autoscaler monitor,
    # the driver's and the worker's core-worker servers, the worker's rendezvous store
    assert len(sockets) >= 8, sockets
    exposed = {
        f"{a}:{p}": command for (a, p), command in sockets.items() if not is_loopback_address(a)
    }
    assert not exposed, f"listening off loopback: {exposed}"


def test_a_killed_trainer_leaves_no_ray_process_or_directory(trainer):
    assert trainer.ray_processes(), "no process carries the run's marker"
    trainer.process.kill()
    died_at = time.monotonic()
    assert trainer.process.wait(30) == -signal.SIGKILL
    print(f"SIGKILL: Ray gone {trainer.seconds_until_gone(died_at):.2f} s after")


def test_a_terminated_trainer_stops_and_leaves_no_ray_process_or_directory(trainer):
    trainer.process.terminate()
    signalled = time.monotonic()
    code = trainer.process.wait(120)
    assert code == 0, f"exit status {code}\n{trainer.log_tail()}"
    exited = time.monotonic()
    gone = trainer.seconds_until_gone(exited)
    print(f"SIGTERM: trainer exited in {exited - signalled:.2f} s, Ray gone {gone:.2f} s after")
