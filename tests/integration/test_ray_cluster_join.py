"""Joining a Ray cluster that runs with token authentication (``cluster.address`` with
``cluster.auth=token``): a real head node started with ``ray start --head`` on loopback and
``RAY_AUTH_MODE=token``; the trainer's ``LocalRay`` joins it with the cluster's token file and
runs a task there, and is refused with another token.

Each join runs in a fresh Python process: Ray reads its authentication settings at import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.support import ROOT, free_port
from trainer.watchdog import kill_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RAY = Path(sys.executable).parent / "ray"

JOIN = textwrap.dedent(
    """
    import sys
    from trainer.cluster import LocalRay
    from trainer.config import ClusterConfig

    config = ClusterConfig(address=sys.argv[1], auth_token_file=sys.argv[2])
    with LocalRay(config, num_cpus=1):
        import ray  # as the trainer does: after LocalRay has set Ray's environment

        print("answer", ray.get(ray.remote(lambda: 6 * 7).remote()), flush=True)
    """
)


def token_file(path: Path, token: str) -> Path:
    path.write_text(token)
    path.chmod(0o600)
    return path


def head_env(token: Path, tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PROXRL_TEST_RAY_HEAD": str(tmp),  # every head process inherits it: stopped by it
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 (see trainer/cluster.py)
        "RAY_USAGE_STATS_ENABLED": "0",
        "HOME": str(tmp),  # nothing of this test under the real home directory
    }


def join(address: str, token: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [sys.executable, "-c", JOIN, address, str(token)],
        cwd=ROOT,
        env={**env, "HOME": str(tmp)},
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_a_trainer_joins_a_token_cluster_with_its_token_and_not_without(tmp_path):
    token = token_file(tmp_path / "cluster_token", "a" * 32 + "0123456789abcdef" * 2)
    port = free_port()
    env = head_env(token, tmp_path)
    ray_dir = tempfile.mkdtemp(prefix="proxrl-rayhead-")  # short: Ray's socket paths must fit
    start = [
        str(RAY), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
        "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats",
        "--temp-dir", ray_dir,
    ]  # fmt: skip
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        address = f"127.0.0.1:{port}"
        joined = join(address, token, tmp_path)
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "answer 42" in joined.stdout

        wrong = token_file(tmp_path / "wrong_token", "b" * 64)
        refused = join(address, wrong, tmp_path)
        assert refused.returncode != 0, refused.stdout
        assert "answer" not in refused.stdout
    finally:  # only this head's processes (`ray stop` would stop every Ray of the machine)
        kill_run(f"PROXRL_TEST_RAY_HEAD={tmp_path}".encode(), ray_dir, spare=())
        shutil.rmtree(ray_dir, ignore_errors=True)
