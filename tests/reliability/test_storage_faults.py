"""Storage faults under load answer 503 with Retry-After, log one line each way, and lose nothing.

Six agents (plain HTTP, one pooled connection each) run short episodes against a real
``proxrl serve``: a new session, two chat turns (one streamed), a reward, the end. Meanwhile
the store fails for a few seconds, as stores do:

- SQLite on a small tmpfs (mounted here; the test runs as root) whose space a filler file takes
  whole, then frees: a full disk;
- Postgres stopped (``pg_ctl -m fast``: connections cut) and started again on the same port.

What must hold: no 500 and no dropped connection; every refusal while the store is down is a
503 with Retry-After; requests succeed again once it is back, without a restart; every turn an
agent was answered is stored; the proxy's log holds one line for the episode's start and one
for its end, and no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support import EngineProcess, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AGENTS = 6
BEFORE_S, DOWN_S, AFTER_S = 4.0, 6.0, 6.0
TMPFS_MB = 32


@dataclass
class Figures:
    statuses: Counter = field(default_factory=Counter)
    without_retry_after: int = 0  # 503s that do not say when to retry
    dropped: int = 0  # transport errors
    acknowledged: list[str] = field(default_factory=list)  # completion ids answered whole
    after_recovery: Counter = field(default_factory=Counter)
    recovered: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tell(self, reply: httpx.Response, completion_id: str | None = None) -> bool:
        with self.lock:
            self.statuses[reply.status_code] += 1
            if self.recovered.is_set():
                self.after_recovery[reply.status_code] += 1
            if reply.status_code == 503 and "retry-after" not in reply.headers:
                self.without_retry_after += 1
            if completion_id is not None:
                self.acknowledged.append(completion_id)
        return reply.status_code in (200, 201)


def agent(proxy: ProxyProcess, figures: Figures, stop: threading.Event, n: int) -> None:
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        while not stop.is_set():
            try:
                episode(http, proxy, figures, n)
            except httpx.TransportError:
                with figures.lock:
                    figures.dropped += 1
                time.sleep(0.2)


def episode(http: httpx.Client, proxy: ProxyProcess, figures: Figures, n: int) -> None:
    created = http.post("/rl/sessions", json={"task_id": f"agent-{n}"}, headers=proxy.admin)
    if not figures.tell(created):
        return time.sleep(0.1)
    session = created.json()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    messages = [{"role": "user", "content": f"Agent {n} says hello."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8}
    reply = http.post("/v1/chat/completions", json=body, headers=headers)
    answer = reply.json() if reply.status_code == 200 else None
    if not figures.tell(reply, answer["id"] if answer else None) or answer is None:
        return
    messages += [answer["choices"][0]["message"], {"role": "user", "content": "Again."}]
    with http.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    whole = any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
    figures.tell(streamed, chunks[0]["id"] if whole else None)
    if not whole:
        return
    path = f"/rl/sessions/{session['session_id']}"
    if figures.tell(http.post(f"{path}/reward", json={"reward": 1.0}, headers=headers)):
        figures.tell(http.post(f"{path}/end", headers=headers))


def drill(
    proxy: ProxyProcess, fault: Callable[[], None], heal: Callable[[], None]
) -> tuple[Figures, float]:
    """Load, the fault for DOWN_S seconds, healed, load; the figures and the seconds from
    healing to the first success."""
    figures, stop = Figures(), threading.Event()
    threads = [
        threading.Thread(target=agent, args=(proxy, figures, stop, n), daemon=True)
        for n in range(AGENTS)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(BEFORE_S)
        fault()
        time.sleep(DOWN_S)
        heal()
        healed = time.monotonic()
        figures.recovered.set()
        while not figures.after_recovery[200] and time.monotonic() - healed < 30:
            time.sleep(0.05)
        first_success = time.monotonic() - healed
        time.sleep(AFTER_S)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return figures, first_success


def check(figures: Figures, first_success: float, log: str, stored: set[str], name: str) -> None:
    lines = log.splitlines()
    down = [line for line in lines if "store unavailable" in line]
    up = [line for line in lines if "store available again" in line]
    tracebacks = sum("Traceback" in line for line in lines)
    missing = [cid for cid in figures.acknowledged if cid not in stored]
    print(
        f"\n{name}: {sum(figures.statuses.values())} requests, {dict(figures.statuses)}; "
        f"503 without Retry-After {figures.without_retry_after}; dropped connections "
        f"{figures.dropped}; log: {len(down)} unavailable + {len(up)} available again, "
        f"{tracebacks} tracebacks, {len(lines)} lines; turns acknowledged "
        f"{len(figures.acknowledged)}, of them stored {len(figures.acknowledged) - len(missing)}; "
        f"first success {first_success:.2f} s after the store came back"
    )
    print("  " + "\n  ".join(down + up))
    assert figures.statuses[503] > 0, "the fault did not reach the clients"
    assert figures.statuses[500] == 0 and figures.dropped == 0
    assert set(figures.statuses) <= {200, 201, 503}, figures.statuses
    assert figures.without_retry_after == 0
    assert figures.after_recovery[200] > 0 and first_success < 10
    assert missing == []
    assert (len(down), len(up), tracebacks) == (1, 1, 0), "\n".join(lines[-40:])


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    with EngineProcess(tiny_model_dir, logs, "--num-threads", "1") as process:
        yield process


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[Path]:
    """A TMPFS_MB tmpfs mounted at ``path``, unmounted however the test ends."""
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """A file that takes every free byte of ``disk``."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as out:
        free = shutil.disk_usage(disk).free
        with contextlib.suppress(OSError):
            out.write(b"\0" * free)
        with contextlib.suppress(OSError):  # what rounding left
            while True:
                out.write(b"\0" * 4096)
    assert shutil.disk_usage(disk).free < 64 * 1024
    return filler


def test_a_full_sqlite_disk_answers_503_and_recovers(tiny_model_dir, tmp_path, engine) -> None:
    assert os.geteuid() == 0, "this drill mounts a tmpfs: run it as root (CI does)"
    with small_disk(tmp_path / "disk") as disk:
        db = disk / "proxrl.db"
        flags = ["--engines", engine.url, "--db", f"sqlite:///{db}"]
        with ProxyProcess(tiny_model_dir, tmp_path / "data", *flags) as proxy:
            filler: list[Path] = []
            figures, first_success = drill(
                proxy, fault=lambda: filler.append(fill(disk)), heal=lambda: filler[0].unlink()
            )
            log = proxy.log_path.read_text()
        with sqlite3.connect(db) as store:
            stored = {row[0] for row in store.execute("SELECT completion_id FROM turns")}
    check(figures, first_success, log, stored, "sqlite, disk full")


def test_a_postgres_restart_answers_503_and_recovers(
    tiny_model_dir, tmp_path, engine, postgres
) -> None:
    import psycopg

    url = postgres.new_database()
    flags = ["--engines", engine.url, "--db", url]
    with ProxyProcess(tiny_model_dir, tmp_path / "data", *flags) as proxy:
        figures, first_success = drill(proxy, fault=postgres.halt, heal=postgres.resume)
        log = proxy.log_path.read_text()
    with psycopg.connect(url) as store:
        stored = {row[0] for row in store.execute("SELECT completion_id FROM turns")}
    check(figures, first_success, log, stored, "postgres, restarted")
