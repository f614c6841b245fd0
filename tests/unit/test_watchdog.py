"""The trainer's Ray watchdog with real processes: which processes it counts as the run's, and
that it acts when its trainer dies even while a forked child still holds its pipe.

(tests/integration/test_ray_isolation.py checks it against a real ``proxrl train``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import ROOT, kill_all, running
from trainer import watchdog

pytestmark = pytest.mark.timeout(60)


def holding(directory: Path, argv0: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``sleep`` under the name ``argv0`` with a file under ``directory`` open (fd 3)."""
    log = directory / "logs" / "raylet.out"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()
    script = f'exec 3<"{log}"; exec -a "{argv0}" sleep 60'
    return subprocess.Popen(["bash", "-c", script], env={**os.environ, **(env or {})})


def test_the_run_s_processes_are_its_ray_programs_and_what_carries_its_marker(tmp_path):
    directory = tmp_path / "proxrl-ray-x"
    marker = f"PROXRL_RAY_DIR={directory}"
    worker = holding(directory, "ray::Worker")
    raylet = holding(directory, "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet")
    reader = holding(directory, "tail")  # someone reading a log: not Ray's
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, "PROXRL_RAY_DIR": str(directory)})
    started = [worker, raylet, reader, marked]
    try:
        time.sleep(0.3)  # bash has exec'd sleep with the file open
        found = set(watchdog.run_processes(marker.encode(), str(directory)))
        assert found == {worker.pid, raylet.pid, marked.pid}
        assert watchdog.run_processes(marker.encode(), str(directory), spare=(worker.pid,))
        assert worker.pid not in watchdog.run_processes(
            marker.encode(), str(directory), spare=(worker.pid,)
        )
    finally:
        kill_all([p.pid for p in started])


TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from trainer import watchdog
    directory = sys.argv[1]
    watchdog.start("PROXRL_RAY_DIR=" + directory, directory)
    child = os.fork()  # holds the watchdog's pipe open after we are gone
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)  # the trainer dies; its forked child lives on
    """
)


def test_a_trainer_s_death_is_noticed_while_a_forked_child_holds_the_pipe(tmp_path):
    directory = tmp_path / "proxrl-ray-y"
    directory.mkdir()
    (directory / "session.log").write_text("ray was here")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,  # the child holds it too: read the line, don't wait for EOF
        text=True,
    )
    assert trainer.stdout is not None
    child = int(trainer.stdout.readline())
    assert trainer.wait(30) == 0
    try:
        deadline = time.monotonic() + 10
        while directory.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not directory.exists(), "the watchdog did not act on its trainer's death"
        assert running(child)  # not a Ray process: left alone
    finally:
        kill_all([child])
