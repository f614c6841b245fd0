"""The trainer's local Ray starts under a long $TMPDIR: its sockets go to a short private
directory (Ray's AF_UNIX paths would pass 107 bytes under the long one, and Ray died with a
traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = """
import tempfile
from trainer.cluster import LocalRay
from trainer.config import ClusterConfig
with LocalRay(ClusterConfig(), num_cpus=1) as cluster:
    import ray
    assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
    print("ray dir", cluster.temp_dir, "tmpdir", tempfile.gettempdir())
"""


def test_local_ray_starts_under_a_long_tmpdir(tmp_path):
    long_tmp = tmp_path / ("long-temporary-directory-" * 4)
    long_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ray_dir = done.stdout.split("ray dir ")[1].split()[0]
    assert len(ray_dir) < 40 and str(long_tmp) in done.stdout
