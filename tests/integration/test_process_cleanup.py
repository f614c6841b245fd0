"""A script that runs ``proxrl serve`` and ``proxrl train`` through ``trainer.run`` (as the demo
and the benchmarks do) and is then killed outright leaves nothing running: the server, its
engine, the trainer and the trainer's Ray processes all stop by themselves.

The script is a real process started here; it is killed with SIGKILL, which it cannot catch,
so only the children's own arrangements (the signal Linux sends them when their parent dies)
can stop them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from client_sdk import Client
from tests.support import ROOT, command_of, descendants, kill_all, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trainer.run import LocalServer, TrainerProcess

    out, model = Path(sys.argv[1]), sys.argv[2]
    server = LocalServer(model, out / "server")
    overrides = ["batch_size=4", "claim_wait_s=0.2", "cluster.cpus_per_worker=1"]
    TrainerProcess(server, out / "trainer", overrides, out / "trainer.log")
    print(server.url, server.admin_key, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_script_leaves_no_server_engine_trainer_or_ray_behind(tmp_path, tiny_model_dir):
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(tiny_model_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "script.log").open("w"),
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    children: list[int] = []
    try:
        assert script.stdout is not None
        url, admin_key = script.stdout.readline().split()
        wait_until_trainer_configured(url, admin_key, tmp_path / "trainer.log")
        children = descendants(script.pid)
        commands = " ".join(command_of(pid) for pid in children)
        for part in ("server.cli serve", "server.cli engine", "server.cli train", "raylet"):
            assert part in commands, f"{part} is not running: {commands}"
        script.kill()
        assert script.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 120
        while (alive := [p for p in children if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, f"left running: {[command_of(pid) for pid in alive]}"
    finally:
        if script.poll() is None:
            script.kill()
        kill_all(children)  # a failed test leaves nothing behind either


def wait_until_trainer_configured(url: str, admin_key: str, log_path: Path) -> None:
    """Until the trainer has set the default run's batch size: its Ray workers are up."""
    deadline = time.monotonic() + 300
    with Client(url, admin_key, timeout=10) as client:
        while time.monotonic() < deadline:
            if any(run["config"].get("batch_size") for run in client.list_runs()):
                return
            time.sleep(0.5)
    raise AssertionError(f"the trainer never configured its run:\n{log_path.read_text()[-3000:]}")
