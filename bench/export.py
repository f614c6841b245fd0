"""How fast ``proxrl export`` writes a run, and how large the files are: a SQLite store seeded
with ``--sessions`` sessions (bench/dashboard.py's seed: every status, one to three turns of 64
prompt and 32 completion tokens), exported with every status in JSONL and in Parquet by the
command's own code (``server.rl.export.export_file``), then read back with
``datasets.load_dataset``. Results go to stdout and bench/results/export.json.

What it does not measure: Postgres, the HTTP endpoint (the same pages and writers, plus the
transfer), long prompts (the size grows with the tokens; the rate mostly with the turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import datasets  # noqa: E402

from bench.dashboard import seed  # noqa: E402
from server.export.writers import FORMATS  # noqa: E402
from server.rl.export import chosen_sessions, export_file  # noqa: E402
from server.store.database import default_url  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    results: dict = {"sessions": args.sessions, "machine": platform.platform(), "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        url = default_url(Path(tmp))
        run_id, _ = seed(url, args.sessions, steps=20, rng=random.Random(0))
        for form, make in FORMATS.items():
            out = Path(tmp) / f"export.{form}"
            chosen = chosen_sessions(run_id, "all", None)
            start = time.perf_counter()
            written = asyncio.run(export_file(url, chosen, make(), out))
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            loaded = datasets.load_dataset(
                "json" if form == "jsonl" else form,
                data_files=str(out),
                split="train",
                cache_dir=str(Path(tmp) / "cache"),
            )
            load_s = time.perf_counter() - start
            assert written == len(loaded) == args.sessions
            size = out.stat().st_size
            results["formats"][form] = {
                "seconds": round(seconds, 3),
                "sessions_per_s": round(written / seconds, 1),
                "bytes": size,
                "bytes_per_session": round(size / written),
                "datasets_load_s": round(load_s, 3),
            }
            print(
                f"{form:8} {written} sessions in {seconds:.2f} s ({written / seconds:,.0f}/s), "
                f"{size / 1e6:.2f} MB ({size / written:,.0f} B/session); "
                f"datasets loads it in {load_s:.2f} s"
            )
    out = ROOT / "bench" / "results" / "export.json"
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
