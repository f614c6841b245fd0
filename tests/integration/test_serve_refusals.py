"""`proxrl serve` refuses bad input at once, in one line that names the flag, exit code 2, and
leaves nothing behind (no data folder, no store): a missing model, a busy port."""

from __future__ import annotations

import socket
import subprocess
import sys

from server.common.tiny_model import create_tiny_model
from tests.support import ROOT


def serve(cwd, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *flags],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_model_is_one_line_and_creates_nothing(tmp_path):
    out = serve(tmp_path, "--model", "./no-such-model")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "proxrl serve: --model ./no-such-model: no such directory (make a model with "
        "`proxrl model init DIR`)"
    ]
    assert out.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_busy_port_is_refused_before_the_store_is_made(tmp_path):
    model = create_tiny_model(tmp_path / "model", "tiny", "default")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = serve(tmp_path, "--model", str(model), "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"proxrl serve: --port {port}: 127.0.0.1:{port} is in use; choose another port"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no data/, no store
