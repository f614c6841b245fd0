"""How fast the dashboard answers with a large store: every page and /admin/api call, timed
against a real ``proxrl serve`` whose SQLite store holds 10,000 sessions.

The store is seeded directly through the store's tables (Core bulk inserts, after the server's
own migrations): one run with ``--sessions`` sessions spread over the last six hours in every
status, one to three turns each (64 prompt and 32 completion tokens, packed as the server packs
them), session rewards on the ended ones, and ``--steps`` trainer steps with the figures the
trainer reports. Then the server starts on that store (its embedded engine on the tiny model)
and each URL is fetched ``--rounds`` times after one warm-up; the median is compared with the
1-second target. Results go to stdout and bench/results/dashboard.json.

What it does not measure: Postgres, many runs, concurrent viewers, or the browser's drawing
time (the run page's charts are the series call plus Plotly's rendering in the browser).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
from sqlalchemy import create_engine, insert  # noqa: E402

from server.common.processes import ProxyProcess  # noqa: E402
from server.store.database import sync_url, upgrade  # noqa: E402
from server.store.packing import pack_floats, pack_ints  # noqa: E402
from server.store.tables import Reward, Run, Session, TrainerStep, Turn  # noqa: E402

TARGET_S = 1.0
STATUSES = [("consumed", 0.7), ("trainable", 0.1), ("ended", 0.08), ("open", 0.05)]
STATUSES.append(("dropped", 1 - sum(share for _, share in STATUSES)))
PROMPT_TOKENS, COMPLETION_TOKENS = 64, 32


def seed(url: str, sessions: int, steps: int, rng: random.Random) -> tuple[str, str]:
    """Fill the store; the seeded run's id and one of its multi-turn sessions."""
    upgrade(url)
    engine = create_engine(sync_url(url))
    now = datetime.now(UTC)
    run_id = f"run-bench-{uuid.uuid4().hex[:12]}"
    session_rows, turn_rows, reward_rows = [], [], []
    names, weights = zip(*STATUSES, strict=True)
    for index in range(sessions):
        created = now - timedelta(seconds=rng.uniform(0, 6 * 3600))
        status = rng.choices(names, weights)[0]
        turns = rng.randint(1, 3)
        breaks = int(turns > 1 and rng.random() < 0.1)
        session_id = f"sess-bench-{index:06d}"
        ended = None if status == "open" else created + timedelta(seconds=rng.uniform(1, 60))
        rewarded = status in ("consumed", "trainable")
        session_rows.append(
            {
                "id": session_id,
                "run_id": run_id,
                "task_id": f"task-{rng.randrange(100)}",
                "group_id": f"group-{index // 8}",
                "metadata": {},
                "api_key_hash": uuid.uuid4().hex + uuid.uuid4().hex,
                "status": status,
                "created_at": created,
                "last_activity_at": ended or created,
                "ended_at": ended,
                "trainable_at": ended if rewarded else None,
                "rewarded": rewarded,
                "turn_count": turns,
                "row_count": 1 + breaks,
                "breaks": breaks,
            }
        )
        prompt: list[int] = []
        for turn in range(turns):
            prompt = prompt + [rng.randrange(300) for _ in range(PROMPT_TOKENS // (turn + 1))]
            completion = [rng.randrange(300) for _ in range(COMPLETION_TOKENS)]
            turn_rows.append(
                {
                    "session_id": session_id,
                    "run_id": run_id,
                    "completion_id": f"chatcmpl-{index:06d}-{turn}",
                    "request_id": f"req-{index:06d}-{turn}",
                    "turn_index": turn,
                    "row_index": 0,
                    "extends_previous": turn > 0,
                    "messages": [{"role": "user", "content": f"question {index}.{turn}"}],
                    "tools": None,
                    "response": {"role": "assistant", "content": "an answer"},
                    "prompt_ids": pack_ints(prompt),
                    "completion_ids": pack_ints(completion),
                    "logprobs": pack_floats([-rng.expovariate(1.0) for _ in completion]),
                    "versions": pack_ints([rng.randrange(steps + 1)] * len(completion)),
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(completion),
                    "finish_reason": "length",
                    "sampling": {},
                    "engine": None,
                    "resubmits": 0,
                    "created_at": created,
                }
            )
            prompt = prompt + completion
        if rewarded:
            reward_rows.append(
                {"session_id": session_id, "target": "session", "value": rng.random()}
                | {"created_at": ended, "completion_id": None}
            )
    step_rows = [
        {
            "run_id": run_id,
            "step": step,
            "version": step,
            "created_at": now - timedelta(seconds=(steps - step) * 20),
            "metrics": trainer_figures(step, steps, now, rng),
        }
        for step in range(1, steps + 1)
    ]
    with engine.begin() as db:
        db.execute(
            insert(Run.__table__),
            [
                {
                    "id": run_id,
                    "name": "bench",
                    "model": "tiny",
                    "config": {},
                    "policy_version": steps,
                    "weights_path": None,
                    "api_key_hash": uuid.uuid4().hex * 2,
                    "is_default": False,
                    "created_at": now - timedelta(hours=6),
                }
            ],
        )
        db.execute(insert(Session.__table__), session_rows)
        db.execute(insert(Turn.__table__), turn_rows)
        db.execute(insert(Reward.__table__), reward_rows)
        db.execute(insert(TrainerStep.__table__), step_rows)
    engine.dispose()
    multi_turn = next(row["id"] for row in session_rows if row["turn_count"] == 3)
    return run_id, multi_turn


def trainer_figures(step: int, steps: int, now: datetime, rng: random.Random) -> dict:
    histogram = [rng.randrange(1000), rng.randrange(300), rng.randrange(30)]
    return {
        "time": (now - timedelta(seconds=(steps - step) * 20)).timestamp(),
        "sessions": 32,
        "dropped_sessions": 0,
        "reward_mean": min(1.0, step / steps + rng.gauss(0, 0.05)),
        "reward_std": 0.2,
        "trained_tokens": sum(histogram),
        "stale_tokens": histogram[2],
        "staleness_mean": 0.3,
        "staleness_max": 2,
        "staleness_histogram": histogram,
        "loss": rng.random(),
        "clip_fraction": rng.random() / 10,
        "behaviour_masked_fraction": rng.random() / 50,
        "behaviour_weight_mean": 1 - rng.random() / 20,
        "grad_norm": rng.random() * 3,
        "train_seconds": 15.0,
        "publish_seconds": 0.5,
        "tokens_per_second": 200.0,
    }


def timed(client: httpx.Client, path: str, rounds: int) -> dict:
    """One warm-up, then ``rounds`` timed fetches; every answer must be a 200."""
    times = []
    size = 0
    for index in range(rounds + 1):
        started = time.perf_counter()
        reply = client.get(path)
        elapsed = time.perf_counter() - started
        if reply.status_code != 200:
            raise RuntimeError(f"{path}: {reply.status_code} {reply.text[:300]}")
        size = len(reply.content)
        if index:
            times.append(elapsed)
    median = statistics.median(times)
    return {"path": path, "median_s": median, "max_s": max(times), "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/dashboard.json")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="proxrl-bench-dashboard-") as tmp:
        from server.common.tiny_model import create_tiny_model

        model = create_tiny_model(Path(tmp) / "tiny", "tiny")
        url = f"sqlite:///{tmp}/store.db"
        started = time.perf_counter()
        run_id, session_id = seed(url, args.sessions, args.steps, rng)
        print(f"seeded {args.sessions:,} sessions in {time.perf_counter() - started:.1f}s")
        admin_key = secrets.token_hex(16)
        with ProxyProcess(model, Path(tmp) / "data", admin_key, "--db", url) as proxy:
            login = httpx.post(
                f"{proxy.url}/admin/login", data={"key": admin_key}, follow_redirects=False
            )
            cookies = {"proxrl_admin": login.cookies["proxrl_admin"]}
            with httpx.Client(base_url=proxy.url, cookies=cookies, timeout=60) as client:
                paths = [
                    "/admin/runs",
                    f"/admin/runs/{run_id}",
                    "/admin/sessions",
                    f"/admin/sessions?run_id={run_id}&status=consumed&reward_min=0.5",
                    f"/admin/sessions?run_id={run_id}&page=190",
                    f"/admin/sessions/{session_id}",
                    "/admin/pool",
                    "/admin/api/runs",
                    f"/admin/api/runs/{run_id}",
                    f"/admin/api/runs/{run_id}/series",
                    f"/admin/api/runs/{run_id}/series?after_step={args.steps - 1}",
                    f"/admin/api/sessions?run_id={run_id}&task_id=task-7&limit=50",
                    "/admin/api/sessions?offset=9950&limit=50",
                    f"/admin/api/sessions/{session_id}",
                    "/admin/api/engines",
                    "/metrics",
                    "/admin/static/plotly.min.js",
                ]
                results = [timed(client, path, args.rounds) for path in paths]
    print(f"\n{'call':<72} {'median':>9} {'max':>9} {'bytes':>10}  < {TARGET_S:.0f} s")
    for result in results:
        ok = "yes" if result["median_s"] < TARGET_S else "NO"
        print(
            f"{result['path'][:72]:<72} {result['median_s'] * 1000:>7.1f}ms "
            f"{result['max_s'] * 1000:>7.1f}ms {result['bytes']:>10,}  {ok}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "sessions": args.sessions,
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
        "all_under_target": all(r["median_s"] < TARGET_S for r in results),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nall under {TARGET_S:.0f} s: {report['all_under_target']} ({args.out})")


if __name__ == "__main__":
    main()
