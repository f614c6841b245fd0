"""Does the proxy scale out: 1, 2 and 3 ``proxrl serve`` replicas over one PostgreSQL store in
front of one stub engine, requests/s and total CPU per request for each, in one run.

A throwaway PostgreSQL cluster (the machine's binaries, a temporary directory, 127.0.0.1, fsync
off) holds the store; bench/stub_engine.py is the engine (the SGLang protocol, no model), so
what is measured is the replicas' own work and the store's. Three replicas start on the same
store and the same stub (the first alone, so that it runs the migrations). Then, for N = 1, 2,
3, ``--clients`` aiohttp clients at once send ``--requests`` non-streamed single-turn chats in
all, each client in a session of its own created on, and sent to, replica ``client % N``
(round-robin by session, the rule a load balancer with session affinity applies; the other
replicas idle). Phases run N = 1, 2, 3 in turn, ``--rounds`` times after a warm-up.

Reported, medians of rounds: requests/s, the replicas' CPU per request summed over the N in
use, PostgreSQL's (the postmaster and its backends, from /proc), and the ratio of each N's
total CPU per request to N = 1's: flat (about 1.0) means no shared hotspot, as the issue asks.
On a machine with fewer cores than replicas + store + client, requests/s cannot grow with N;
CPU per request is the figure that says whether it could. Results go to stdout and
bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp  # noqa: E402

from bench.common import (  # noqa: E402
    StubEngine,
    new_sessions,
    per_client,
    positive_int,
    process_cpu,
    process_stat,
)
from bench.proxy import ChatRequest, ensure_model, make_requests  # noqa: E402
from bench.proxy_cost import TIMEOUT, proxy_send  # noqa: E402
from server.common.processes import ProxyProcess, free_port, wait_all  # noqa: E402
from server.text.tokenization import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "replicas.json"
LOG_DIR = ROOT / ".cache" / "bench"
SEED = 0
REPLICAS = (1, 2, 3)


class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (as root, run as the ``postgres`` user, which
    PostgreSQL requires)."""

    def __init__(self) -> None:
        debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        found = shutil.which("pg_ctl") or (debian[-1] if debian else None)
        if not found:
            raise SystemExit("PostgreSQL is not installed (apt-get install -y postgresql)")
        self.bin = Path(os.path.realpath(found)).parent
        self.root = Path(tempfile.mkdtemp(prefix="proxrl-bench-postgres-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> None:
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_user, *command], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust")
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "server.log"), "-w", "start",
        )  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def cpu(self) -> float:
        """CPU seconds of the postmaster, its live backends and those that have exited."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        total = process_cpu(postmaster, children=True)
        for stat in glob.glob("/proc/[0-9]*/stat"):
            pid = int(stat.split("/")[2])
            fields = process_stat(pid)
            if fields is not None and int(fields[1]) == postmaster:
                total += process_cpu(pid)
        return total


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Measured:
    seconds: float
    requests: int
    replicas_cpu: float  # the N replicas in use, summed
    store_cpu: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


async def sessions_on(replicas: list[ProxyProcess], count: int) -> list[dict]:
    """``count`` sessions, the i-th made on replica ``i % len(replicas)``."""
    sessions = []
    for index in range(count):
        replica = replicas[index % len(replicas)]
        sessions += await new_sessions(replica.url, replica.admin, 1)
    return sessions


async def run_clients(sessions: list[dict], chats: list[list[ChatRequest]], tokens: int) -> None:
    """Each client's chats in its session (on the replica that made it), all clients at once."""
    connector = aiohttp.TCPConnector(limit=len(chats) + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as http:

        async def client(index: int) -> None:
            for chat in chats[index]:
                await proxy_send(http, sessions[index], chat, False, tokens)

        await asyncio.gather(*(client(i) for i in range(len(chats))))


def measure(
    replicas: list[ProxyProcess], store: Postgres, chats: list[list[ChatRequest]], tokens: int
) -> Measured:
    sessions = asyncio.run(sessions_on(replicas, len(chats)))  # not measured
    before = [process_cpu(r.process.pid) for r in replicas], store.cpu()
    started = time.perf_counter()
    asyncio.run(run_clients(sessions, chats, tokens))
    seconds = time.perf_counter() - started
    after = [process_cpu(r.process.pid) for r in replicas], store.cpu()
    used = sum(a - b for a, b in zip(after[0], before[0], strict=True))
    return Measured(seconds, sum(len(c) for c in chats), used, after[1] - before[1])


def summarize(rounds: dict[int, list[Measured]]) -> dict[int, dict]:
    rows = {}
    for count, measured in rounds.items():
        rows[count] = {
            "replicas": count,
            "requests_per_s": statistics.median(m.requests_per_s for m in measured),
            "replicas_cpu_ms_per_request": statistics.median(
                1000 * m.replicas_cpu / m.requests for m in measured
            ),
            "store_cpu_ms_per_request": statistics.median(
                1000 * m.store_cpu / m.requests for m in measured
            ),
        }
    base = rows[1]["replicas_cpu_ms_per_request"] + rows[1]["store_cpu_ms_per_request"]
    for row in rows.values():
        row["total_cpu_ms_per_request"] = (
            row["replicas_cpu_ms_per_request"] + row["store_cpu_ms_per_request"]
        )
        row["total_vs_one"] = row["total_cpu_ms_per_request"] / base
    return rows


def markdown(rows: dict[int, dict]) -> str:
    lines = [
        "| replicas | req/s | replicas' CPU ms/req | Postgres CPU ms/req | total | vs 1 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows.values():
        lines.append(
            f"| {row['replicas']} | {row['requests_per_s']:.0f} "
            f"| {row['replicas_cpu_ms_per_request']:.2f} | {row['store_cpu_ms_per_request']:.2f} "
            f"| {row['total_cpu_ms_per_request']:.2f} | {row['total_vs_one']:.2f}x |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=600,
        help="Requests per phase, split between the clients (default: 600).",
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=12,
        help="Concurrent clients, a session each (default: 12).",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="Rounds of N = 1, 2, 3 after a warm-up; medians are reported (default: 3).",
    )
    parser.add_argument(
        "--tokens", type=positive_int, default=16, help="Tokens per answer (default: 16)."
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    model_dir = ensure_model()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    each = max(args.requests // args.clients, 1)
    chats = make_requests(tokenizer, random.Random(SEED), each * args.clients)
    clients = per_client(chats, args.clients)
    warm = [c[:2] for c in clients]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    admin_key = secrets.token_hex(16)
    rounds: dict[int, list[Measured]] = {count: [] for count in REPLICAS}
    with (
        tempfile.TemporaryDirectory(prefix="proxrl-bench-") as data_dir,
        postgres() as store,
        StubEngine(model_dir, LOG_DIR / "replicas-stub.log", args.tokens) as stub,
    ):
        flags = ("--engines", stub.url, "--db", store.url)
        replicas = [ProxyProcess(model_dir, Path(data_dir) / "r0", admin_key, *flags)]
        try:
            replicas[0].wait_ready()  # alone: it runs the migrations
            for index in (1, 2):
                directory = Path(data_dir) / f"r{index}"
                replicas.append(ProxyProcess(model_dir, directory, admin_key, *flags))
            wait_all(replicas)
            for round_ in range(args.rounds + 1):
                print("warm-up" if round_ == 0 else f"round {round_}/{args.rounds}", flush=True)
                for count in REPLICAS:
                    measured = measure(
                        replicas[:count], store, warm if round_ == 0 else clients, args.tokens
                    )
                    if round_ > 0:
                        rounds[count].append(measured)
                    print(
                        f"  {count} replica(s): {measured.requests_per_s:.0f} req/s, "
                        f"{1000 * measured.replicas_cpu / measured.requests:.2f} ms replicas' "
                        f"CPU/req, {1000 * measured.store_cpu / measured.requests:.2f} ms "
                        "Postgres CPU/req",
                        flush=True,
                    )
        finally:
            for replica in replicas:
                replica.stop()
    rows = summarize(rounds)
    table = markdown(rows)
    total = time.perf_counter() - started
    print(f"\n{table}\n\ntotal {total:.0f}s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "args": vars(args),
        "rows": rows,
        "table": table,
        "rounds": {count: [vars(m) for m in measured] for count, measured in rounds.items()},
        "total_seconds": total,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
