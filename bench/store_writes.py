"""What the store writes per turn and per token, and how many turns per second it takes, through
the server's own turn writer (``server.store.writer.TurnWriter``), on PostgreSQL and SQLite.

A throwaway PostgreSQL cluster (bench/replicas.py's: the machine's binaries, a temporary
directory, 127.0.0.1) with ``fsync`` on by default (as a production store has it; ``--fsync off``
is how the tests and the other benches run it) and ``pg_stat_statements`` loaded; and a SQLite
file in WAL mode, as ``proxrl serve`` opens it. Each store is migrated (``database.upgrade``)
and holds one run and sessions made by ``server.store.sessions.create_session``.

Each turn shape (``--shapes PROMPT:COMPLETION`` tokens; every completion token with its logprob
and version, the prompt with its messages as text of about 4 characters per token) is written
in phases of ``--turns`` turns:

- **one at a time**: one producer, each turn committed before the next is handed over (every
  batch is one turn): a single writer with nothing to batch;
- **batched, max_batch=K** (``--batches``; the server's writer uses 256): ``--producers``
  concurrent producers (a session each, as concurrent requests are) hand their turns to one
  writer, which commits what is queued, up to K turns, in one transaction.

Reported per phase: turns/s, the mean turns per transaction, and per turn: statements the store
executed (Postgres: ``pg_stat_statements``, every statement with its BEGIN and COMMIT, counted
by the server: the turn writer runs SQLAlchemy's compiled SQL on the driver's cursor, past the
``before_cursor_execute`` events Core fires, so a client-side count would miss them), WAL
bytes (``pg_current_wal_lsn``), bytes the tables grew (``pg_total_relation_size`` of turns and
sessions: heap, TOAST, indexes; SQLite: the file after a full checkpoint), the values' own
bytes (what the writer sends), Postgres CPU (the postmaster and its backends, from /proc) and
this process's CPU (the writer and its producers). Per token: bytes = a + b * prompt tokens +
c * completion tokens, fitted by least squares over the shapes of the batched phases. The
producers, the writer and the database share the machine's cores: turns/s says how fast this
machine went, the bytes and statements what a turn costs anywhere. Results go to stdout and
bench/results/store_writes.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psycopg  # noqa: E402

from bench.common import positive_int  # noqa: E402
from bench.replicas import Postgres  # noqa: E402
from server.store import database  # noqa: E402
from server.store.runs import create_run  # noqa: E402
from server.store.sessions import create_session  # noqa: E402
from server.store.turns import TurnRecord  # noqa: E402
from server.store.writer import TurnWriter  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "store_writes.json"
SEED = 0
VOCABULARY = 151_000  # a Qwen-sized vocabulary: token ids as a real model's spread
WORDS = [
    "the", "agent", "reads", "file", "and", "writes", "a", "patch", "to", "fix", "test",
    "error", "function", "returns", "value", "when", "input", "is", "empty", "list", "of",
    "tokens", "python", "import", "class", "def", "self", "for", "in", "range", "if", "not",
    "None", "print", "result", "output", "tool", "call", "shell", "command", "exit", "code",
]  # fmt: skip
VARIANTS = 16  # distinct payloads per shape, reused across turns (each row is compressed alone)


class MeasuredPostgres(Postgres):
    """bench/replicas.py's throwaway cluster, with ``fsync`` as asked and ``pg_stat_statements``
    loaded."""

    def __init__(self, fsync: bool) -> None:
        super().__init__()
        self.fsync = fsync

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust")
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            f"-c fsync={'on' if self.fsync else 'off'} "
            "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "server.log"), "-w", "start",
        )  # fmt: skip
        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute("CREATE EXTENSION pg_stat_statements")


@contextlib.contextmanager
def measured_postgres(fsync: bool) -> Iterator[MeasuredPostgres]:
    server = MeasuredPostgres(fsync)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Shape:
    prompt: int
    completion: int

    @property
    def name(self) -> str:
        return f"{self.prompt}+{self.completion}"


def shape(text: str) -> Shape:
    """An argparse type: ``PROMPT:COMPLETION`` tokens."""
    try:
        prompt, completion = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROMPT:COMPLETION, got {text!r}") from None
    if prompt < 1 or completion < 1:
        raise argparse.ArgumentTypeError(f"both must be at least 1, got {text!r}")
    return Shape(prompt, completion)


def text_of(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text: words of ~4 characters with their spaces."""
    return " ".join(rng.choices(WORDS, k=tokens))


def payloads(rng: random.Random, turn: Shape) -> list[dict[str, Any]]:
    """``VARIANTS`` turns' worth of tokens, logprobs and text of the shape."""
    made = []
    for _ in range(VARIANTS):
        made.append(
            {
                "prompt_ids": [rng.randrange(VOCABULARY) for _ in range(turn.prompt)],
                "completion_ids": [rng.randrange(VOCABULARY) for _ in range(turn.completion)],
                "logprobs": [-rng.expovariate(2.0) for _ in range(turn.completion)],
                "messages": [
                    {"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": text_of(rng, turn.prompt)},
                ],
                "response": {"role": "assistant", "content": text_of(rng, turn.completion)},
            }
        )
    return made


def records(
    run_id: str, session_ids: list[str], each: int, made: list[dict[str, Any]]
) -> list[list[TurnRecord]]:
    """``each`` turns for every session, as the proxy hands them to the writer."""
    out = []
    for number, session_id in enumerate(session_ids):
        turns = []
        for index in range(each):
            payload = made[(number + index) % len(made)]
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            turns.append(
                TurnRecord(
                    session_id=session_id, run_id=run_id, completion_id=completion_id,
                    request_id=completion_id, surface="chat", model="policy",
                    turn_index=index, row_index=0, extends_previous=index > 0, conversation=0,
                    messages=payload["messages"], tools=None, response=payload["response"],
                    prompt_ids=payload["prompt_ids"], completion_ids=payload["completion_ids"],
                    logprobs=payload["logprobs"], versions=[0] * len(payload["completion_ids"]),
                    finish_reason="stop",
                    sampling={"temperature": 1.0, "max_tokens": 2048, "stop": [], "seed": None,
                              "n": 1},
                    engine="http://gpu-1:30000", resubmits=0, new_row=index == 0,
                    new_conversation=index == 0,
                )
            )  # fmt: skip
        out.append(turns)
    return out


class Store:
    """One migrated store: its URL, a run, and what it measures before and after a phase."""

    def __init__(self, name: str, url: str, postgres: MeasuredPostgres | None = None) -> None:
        self.name, self.url, self.postgres = name, url, postgres
        database.upgrade(url)
        self.run_id = asyncio.run(self._new_run())
        self.session_statements: list[dict[str, float]] = []

    async def _new_run(self) -> str:
        engine = database.connect(self.url)
        try:
            async with database.sessionmaker(engine)() as db:
                run, _ = await create_run(db, "bench", "policy", {})
                await db.commit()
                return run.id
        finally:
            await engine.dispose()

    async def new_sessions(self, count: int) -> list[str]:
        """``count`` sessions, each made and committed as the server makes one."""
        engine = database.connect(self.url)
        made = []
        try:
            for _ in range(count):
                async with database.sessionmaker(engine)() as db:
                    session, _ = await create_session(db, self.run_id, "bench", None, {})
                    await db.commit()
                    made.append(session.id)
        finally:
            await engine.dispose()
        return made

    def snapshot(self) -> dict[str, float]:
        """What grows with writes: table bytes, WAL position, statements, CPU."""
        if self.postgres is None:
            path = Path(str(database.sqlite_file(self.url)))
            with contextlib.closing(sqlite3.connect(path)) as connection:
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return {"table_bytes": path.stat().st_size, "cpu": time.process_time()}
        with psycopg.connect(self.url, autocommit=True) as db:
            sizes, wal, statements = db.execute(
                "SELECT pg_total_relation_size('turns') + pg_total_relation_size('sessions'),"
                " pg_current_wal_lsn() - '0/0'::pg_lsn,"
                " (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
                "  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                "  AND query !~ 'pg_')"
            ).fetchone()
        return {
            "table_bytes": float(sizes),
            "wal_bytes": float(wal),
            "statements": float(statements),
            "store_cpu": self._store_cpu(),
            "cpu": time.process_time(),
        }

    def _store_cpu(self) -> float:
        """Postgres's CPU seconds; read again when a backend exited while it was being read
        (``Postgres.cpu`` lists the backends, then reads each: one gone between is NaN)."""
        assert self.postgres is not None
        for _ in range(5):
            seconds = self.postgres.cpu()
            if not math.isnan(seconds):
                return seconds
        return seconds

    def statement_kinds(self) -> dict[str, int]:
        """Statements executed since the last reset, by their first word (Postgres)."""
        if self.postgres is None:
            return {}
        with psycopg.connect(self.url, autocommit=True) as db:
            rows = db.execute(
                "SELECT upper(split_part(ltrim(query), ' ', 1)), sum(calls) FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND query !~ 'pg_' GROUP BY 1"
            ).fetchall()
        return {kind: int(calls) for kind, calls in rows}

    def reset_statements(self) -> None:
        if self.postgres is not None:
            with psycopg.connect(self.url, autocommit=True) as db:
                db.execute("SELECT pg_stat_statements_reset()")


@dataclass(frozen=True)
class Phase:
    store: str
    shape: str
    prompt_tokens: int
    completion_tokens: int
    mode: str  # "one at a time" or "batched"
    max_batch: int
    producers: int
    turns: int
    seconds: float
    transactions: int
    payload_bytes: float
    deltas: dict[str, float]
    statement_kinds: dict[str, int]

    @property
    def kinds_row(self) -> dict[str, Any]:
        """The statements the phase executed, by kind (BEGIN, INSERT, UPDATE, COMMIT, ...)."""
        return {"store": self.store, "shape": self.shape, "mode": self.mode,
                "max_batch": self.max_batch, "kinds": self.statement_kinds}  # fmt: skip

    @property
    def row(self) -> dict[str, Any]:
        per_turn = {key: value / self.turns for key, value in self.deltas.items()}
        return {
            "store": self.store,
            "shape": self.shape,
            "mode": self.mode,
            "max_batch": self.max_batch,
            "turns_per_s": self.turns / self.seconds,
            "turns_per_transaction": self.turns / self.transactions,
            "statements_per_turn": per_turn.get("statements"),
            "wal_bytes_per_turn": per_turn.get("wal_bytes"),
            "table_bytes_per_turn": per_turn["table_bytes"],
            "payload_bytes_per_turn": self.payload_bytes / self.turns,
            "store_cpu_ms_per_turn": (
                1000 * per_turn["store_cpu"] if "store_cpu" in per_turn else None
            ),
            "writer_cpu_ms_per_turn": 1000 * per_turn["cpu"],
        }


async def write_all(url: str, work: list[list[TurnRecord]], max_batch: int) -> tuple[float, Any]:
    """Every producer's turns through one writer, each turn awaited before its producer's next;
    the wall time and the writer's stats."""
    engine = database.connect_sync(url)
    writer = TurnWriter(engine, max_batch=max_batch)
    writer.start()
    try:

        async def producer(turns: list[TurnRecord]) -> None:
            for record in turns:
                await writer.write([record])

        started = time.perf_counter()
        await asyncio.gather(*(producer(turns) for turns in work))
        seconds = time.perf_counter() - started
    finally:
        await writer.stop()
        engine.dispose()
    return seconds, writer.stats


def measure(store: Store, turn: Shape, made: list, turns: int, producers: int, max_batch: int):
    each = max(turns // producers, 1)
    store.reset_statements()
    sessions = asyncio.run(store.new_sessions(producers))
    if store.postgres is not None:
        kinds = store.statement_kinds()
        store.session_statements.append({k: v / producers for k, v in kinds.items()})
    work = records(store.run_id, sessions, each, made)
    payload = sum(
        sum(len(json.dumps(value)) for value in (r.messages, r.response, r.sampling))
        + 4 * (len(r.prompt_ids) + 3 * len(r.completion_ids))
        for turns_ in work
        for r in turns_
    )
    store.reset_statements()
    before = store.snapshot()
    seconds, stats = asyncio.run(write_all(store.url, work, max_batch))
    after = store.snapshot()
    deltas = {key: after[key] - before[key] for key in before}
    return Phase(
        store=store.name, shape=turn.name, prompt_tokens=turn.prompt,
        completion_tokens=turn.completion, mode="one at a time" if producers == 1 else "batched",
        max_batch=max_batch, producers=producers, turns=each * producers, seconds=seconds,
        transactions=stats.batches, payload_bytes=payload, deltas=deltas,
        statement_kinds=store.statement_kinds(),
    )  # fmt: skip


def per_token(phases: list[Phase], key: str) -> dict[str, float] | None:
    """``key`` per turn = a + b * prompt tokens + c * completion tokens, least squares over the
    shapes; None when the shapes do not tell prompt from completion tokens."""
    rows = [p for p in phases if p.row[key] is not None]
    design = np.array([[1.0, p.prompt_tokens, p.completion_tokens] for p in rows])
    if len(rows) < 3 or np.linalg.matrix_rank(design) < 3:
        return None
    values = np.array([p.row[key] for p in rows])
    (fixed, prompt, completion), *_ = np.linalg.lstsq(design, values, rcond=None)
    return {"per_turn": fixed, "per_prompt_token": prompt, "per_completion_token": completion}


def fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def markdown(phases: list[Phase]) -> str:
    lines = [
        "| store | turn (prompt+completion) | mode | max_batch | turns/s | turns/txn "
        "| statements/turn | WAL bytes/turn | table bytes/turn | values' bytes/turn "
        "| store CPU ms/turn | writer CPU ms/turn |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in phases:
        row = phase.row
        lines.append(
            f"| {row['store']} | {row['shape']} | {row['mode']} | {row['max_batch']} "
            f"| {fmt(row['turns_per_s'])} | {fmt(row['turns_per_transaction'], 1)} "
            f"| {fmt(row['statements_per_turn'], 2)} | {fmt(row['wal_bytes_per_turn'])} "
            f"| {fmt(row['table_bytes_per_turn'])} | {fmt(row['payload_bytes_per_turn'])} "
            f"| {fmt(row['store_cpu_ms_per_turn'], 3)} | {fmt(row['writer_cpu_ms_per_turn'], 3)} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=2048,
        help="Turns per phase, split between the producers (default: 2048).",
    )
    parser.add_argument(
        "--producers",
        type=positive_int,
        default=256,
        help="Concurrent producers in the batched phases, a session each (default: 256).",
    )
    parser.add_argument(
        "--batches",
        type=positive_int,
        nargs="+",
        default=[1, 16, 256],
        help="The writer's max_batch in the batched phases (default: 1 16 256; the server "
        "uses 256).",
    )
    parser.add_argument(
        "--shapes",
        type=shape,
        nargs="+",
        default=[Shape(512, 16), Shape(512, 1024), Shape(4096, 16)],
        help="Turn shapes, PROMPT:COMPLETION tokens (default: 512:16 512:1024 4096:16; three "
        "shapes that differ in each are what the per-token fit needs).",
    )
    parser.add_argument(
        "--fsync",
        choices=["on", "off"],
        default="on",
        help="PostgreSQL's fsync (default: on, as a production store; the tests run it off).",
    )
    parser.add_argument(
        "--no-sqlite", action="store_true", help="Measure PostgreSQL only (default: both)."
    )
    return parser.parse_args()


def run_store(store: Store, args: argparse.Namespace) -> list[Phase]:
    rng = random.Random(SEED)
    phases = []
    for turn in args.shapes:
        made = payloads(rng, turn)
        settings = [(1, 256)] + [(args.producers, batch) for batch in args.batches]
        for producers, max_batch in settings:
            phase = measure(store, turn, made, args.turns, producers, max_batch)
            row = phase.row
            print(
                f"  {store.name} {turn.name} {phase.mode} max_batch={max_batch}: "
                f"{row['turns_per_s']:.0f} turns/s, {row['turns_per_transaction']:.1f} "
                f"turns/txn, {row['table_bytes_per_turn']:.0f} table bytes/turn",
                flush=True,
            )
            phases.append(phase)
    return phases


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    phases: list[Phase] = []
    with measured_postgres(args.fsync == "on") as server:
        store = Store("postgres", server.url, server)
        phases += run_store(store, args)
        session_statements = store.session_statements[-1]
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory(prefix="proxrl-bench-store-") as directory:
            store = Store("sqlite", database.default_url(Path(directory)))
            phases += run_store(store, args)
    table = markdown(phases)
    fits = {}
    for name in ("postgres", "sqlite"):
        batched = [
            p for p in phases if p.store == name and p.max_batch == max(args.batches)
            and p.mode == "batched"
        ]  # fmt: skip
        fits[name] = {
            key: per_token(batched, key)
            for key in ("table_bytes_per_turn", "wal_bytes_per_turn", "payload_bytes_per_turn")
        }
    total = time.perf_counter() - started
    print(f"\n{table}\n")
    for name, by_key in fits.items():
        for key, fit in by_key.items():
            if fit is not None:
                print(
                    f"{name} {key}: {fit['per_turn']:,.0f} + {fit['per_prompt_token']:.2f} x "
                    f"prompt tokens + {fit['per_completion_token']:.2f} x completion tokens"
                )
    print(f"Postgres statements per session made (create_session, commit): {session_statements}")
    print(f"total {total:.0f}s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "args": {**vars(args), "shapes": [asdict(s) for s in args.shapes]},
        "rows": [phase.row for phase in phases],
        "statement_kinds": [phase.kinds_row for phase in phases],
        "per_token": fits,
        "session_statements": session_statements,
        "table": table,
        "total_seconds": total,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
