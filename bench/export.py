"""How fast ``proxrl export`` writes a run, how large the files are, and that its memory does not
grow with the run: SQLite stores seeded with ``--sessions`` sessions each (bench/dashboard.py's
seed: every status, one to three turns of 64 prompt and 32 completion tokens), exported with
every status in JSONL and in Parquet by the command's own code (``server.rl.export.export_file``,
timed in this process), then by the ``proxrl export`` command as a process of its own (its peak
resident memory), and read back with ``datasets.load_dataset``. Results go to stdout and
bench/results/export.json.

What it does not measure: Postgres, the HTTP endpoint (the same pages and writers, plus the
transfer), long prompts (the size grows with the tokens; the rate mostly with the turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
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

# The command's own peak resident memory (VmHWM, Linux), printed as it exits: getrusage's
# ru_maxrss of a child also counts the parent's image copied by the fork before the exec.
PEAK = (
    "import atexit, sys\n"
    "def peak():\n"
    "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "    print('PEAK_KB', hwm.split()[1], file=sys.stderr)\n"
    "atexit.register(peak)\n"
    "from server.cli import main\n"
    "main(sys.argv[1:])\n"
)


def command_peak_mb(url: str, run_id: str, form: str, out: Path) -> float:
    """Run ``proxrl export`` as a process; its peak resident memory in MB."""
    command = [sys.executable, "-c", PEAK, "export", "--db", url, "--run", run_id]
    command += ["--status", "all", "--format", form, str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    kb = next(line for line in done.stderr.splitlines() if line.startswith("PEAK_KB"))
    return int(kb.split()[1]) / 1024


def measure(sessions: int, tmp: Path) -> dict:
    url = default_url(tmp)
    run_id, _ = seed(url, sessions, steps=20, rng=random.Random(0))
    found: dict = {}
    for form, make in FORMATS.items():
        out = tmp / f"export.{form}"
        start = time.perf_counter()
        written = asyncio.run(export_file(url, chosen_sessions(run_id, "all", None), make(), out))
        seconds = time.perf_counter() - start
        size = out.stat().st_size
        peak_mb = command_peak_mb(url, run_id, form, tmp / f"command.{form}")
        start = time.perf_counter()
        loaded = datasets.load_dataset(
            "json" if form == "jsonl" else form,
            data_files=str(out),
            split="train",
            cache_dir=str(tmp / f"cache-{form}"),
        )
        load_s = time.perf_counter() - start
        assert written == len(loaded) == sessions
        found[form] = {
            "seconds": round(seconds, 3),
            "sessions_per_s": round(written / seconds, 1),
            "bytes": size,
            "bytes_per_session": round(size / written),
            "command_peak_rss_mb": round(peak_mb, 1),
            "datasets_load_s": round(load_s, 3),
        }
        print(
            f"{sessions:>6} sessions {form:8} {seconds:6.2f} s ({written / seconds:,.0f}/s), "
            f"{size / 1e6:7.2f} MB ({size / written:,.0f} B/session), command peak "
            f"{peak_mb:.0f} MB RSS; datasets loads it in {load_s:.2f} s"
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1000,10000", help="Comma-separated run sizes.")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    results: dict = {"machine": platform.platform(), "cpus": os.cpu_count(), "runs": {}}
    for sessions in [int(n) for n in args.sessions.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            results["runs"][sessions] = measure(sessions, Path(tmp))
    out = ROOT / "bench" / "results" / "export.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
