"""What the benchmark scripts share: argument types, new sessions on a proxy, the stub engine
and the bare forwarder as processes, a process's CPU time."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import httpx

from server.common.processes import ServerProcess, free_port

BENCH = Path(__file__).resolve().parent


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


async def new_sessions(
    url: str, admin: dict[str, str], count: int, run_id: str | None = None
) -> list[dict]:
    """``count`` new sessions on the proxy at ``url`` (``admin``: its admin key headers), in
    ``run_id`` (default: the proxy's default run): each one's id, api_key and base_url."""
    body = {"task_id": "bench", **({"run_id": run_id} if run_id else {})}
    async with httpx.AsyncClient(headers=admin, timeout=60) as http:
        replies = [await http.post(f"{url}/rl/sessions", json=body) for _ in range(count)]
    for reply in replies:
        reply.raise_for_status()
    return [reply.json() for reply in replies]


class StubEngine(ServerProcess):
    """bench/stub_engine.py as a process on loopback: the SGLang protocol, no model."""

    name = "stub engine"
    ready_path = "/model_info"
    ready_timeout = 60.0

    def __init__(
        self, model_dir: Path, log_path: Path, tokens: int = 16, chunk_interval_ms: float = 0.0
    ) -> None:
        self.port = free_port()
        command = [
            sys.executable, str(BENCH / "stub_engine.py"), "--model", str(model_dir),
            "--port", str(self.port), "--tokens", str(tokens),
            "--chunk-interval-ms", str(chunk_interval_ms),
        ]  # fmt: skip
        super().__init__(command, f"http://127.0.0.1:{self.port}", log_path)


class Forwarder(ServerProcess):
    """bench/forwarder.py as a process on loopback, in front of an engine."""

    name = "bare forwarder"
    ready_timeout = 60.0

    def __init__(self, engine_url: str, log_path: Path) -> None:
        self.port = free_port()
        command = [sys.executable, str(BENCH / "forwarder.py"), engine_url, str(self.port)]
        super().__init__(command, f"http://127.0.0.1:{self.port}", log_path)


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state first); None when the
    process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of a process, all its threads (``children``: and of its
    children that have exited and been waited for); NaN where /proc is missing."""
    fields = process_stat(pid)
    if fields is None:
        return math.nan
    counted = (11, 12, 13, 14) if children else (11, 12)
    return sum(int(fields[i]) for i in counted) / os.sysconf("SC_CLK_TCK")


def per_client(requests: list, clients: int) -> list[list]:
    """``requests`` dealt to ``clients`` in equal runs (the remainder left out)."""
    each = max(len(requests) // clients, 1)
    return [requests[i * each : (i + 1) * each] for i in range(clients)]
