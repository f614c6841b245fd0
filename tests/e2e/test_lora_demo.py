"""The two-run LoRA demo, end to end and for real: `proxrl demo --lora` in a short mode (issue
29, part 5).

It runs as a user runs it: the warm-up on both tasks (cached under .proxrl-cache), one `proxrl
serve` with its embedded engine, a `proxrl train` per run (LoRA), and the math agent's sessions
of both runs at once through the openai SDK; run ``add`` is rolled back mid-way by
``POST /rl/runs/{id}/rollback``. The demo ends by itself and writes summary.json (with each
run's view and lineage as the server reported them at the end) and the plot. Then:

- both runs' rewards rose: the trainers' own record (metrics.jsonl, each step's mean reward
  over its BATCH sessions): the mean of the last WINDOW_STEPS steps against the first
  WINDOW_STEPS' (for ``add``, the last steps after the rollback), by MIN_GAIN;
- the rollback is in ``add``'s lineage: version r has parent (the version current before) and
  source (the version rolled back to) as the demo called it, the versions after r descend
  from it, and the server lists the pair in ``rollbacks``; ``sub``'s lineage has no rollback
  and each of its versions descends from the one before;
- each session trained once: no session in both runs' steps; in each run's lineage (for
  ``add``, leaving out the steps of the versions the rollback discarded, whose sessions the
  trainer released to train again) each session is in one step, and the server counts
  exactly those as consumed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MINUTES = 3.0  # of training
ROLLBACK_AT = 12  # run add's version that starts the rollback ...
ROLLBACK_BY = 6  # ... to the version this many before
# Steps of 32 sessions: 384 sessions each side, three times over each of a run's 16 problems
# (8 sessions each), so that the problems' own difficulty weighs the same in both means.
WINDOW_STEPS = 12
MIN_GAIN = 0.10


def run_demo(out) -> float:
    """The demo, to its end; its wall time."""
    arguments = [
        "--out", str(out), "--seed", "0", "--minutes", str(MINUTES),
        "--rollback-at", str(ROLLBACK_AT), "--rollback-by", str(ROLLBACK_BY), "--no-keep-serving",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "demo", "--lora", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return time.monotonic() - started


def steps(out, name: str) -> list[dict]:
    path = out / f"trainer-{name}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def gain(records: list[dict]) -> tuple[float, float]:
    rewards = [record["reward_mean"] for record in records]
    assert len(rewards) >= 2 * WINDOW_STEPS, len(rewards)
    return statistics.mean(rewards[:WINDOW_STEPS]), statistics.mean(rewards[-WINDOW_STEPS:])


def test_two_lora_runs_learn_two_tasks_with_a_rollback(tmp_path):
    out = tmp_path / "demo"
    seconds = run_demo(out)
    summary = json.loads((out / "summary.json").read_text())
    add, sub = summary["runs"]["add"], summary["runs"]["sub"]
    records = {name: steps(out, name) for name in ("add", "sub")}
    figures = {name: gain(records[name]) for name in records}
    print(f"demo took {seconds:.0f} s; first and last {WINDOW_STEPS} steps' reward: {figures}")
    print(f"add's rollback: {add['rollbacks']}")
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # both runs learn, each its own task
    for name, (first, last) in figures.items():
        assert last - first >= MIN_GAIN, (name, first, last)

    # the rollback, as the demo made it and as the server keeps it
    (rollback,) = add["rollbacks"]
    source, version = rollback["source"], rollback["version"]
    assert rollback["from"] >= ROLLBACK_AT and source == rollback["from"] - ROLLBACK_BY, rollback
    assert version == rollback["from"] + 1, rollback
    lineage = {row["version"]: row for row in add["lineage"]}
    assert lineage[version]["source"] == source and lineage[version]["parent"] == rollback["from"]
    assert add["server"]["rollbacks"] == [[source, version]], add["server"]
    after = sorted(v for v in lineage if v > version)
    assert after, "run add trained on after its rollback"
    for v in after:  # the trainer followed: each next version descends from the rollback
        assert lineage[v]["parent"] == v - 1 and lineage[v]["source"] is None, lineage[v]
    assert add["policy_version"] == max(lineage)

    # run sub went on unaffected: no rollback, one straight line of versions
    assert sub["rollbacks"] == [] and sub["server"]["rollbacks"] == [], sub["server"]
    assert all(row["source"] is None for row in sub["lineage"]), sub["lineage"]
    assert [row["parent"] for row in sub["lineage"] if row["version"] > 0] == [
        row["version"] - 1 for row in sub["lineage"] if row["version"] > 0
    ]

    # each session trained once: no session in both runs; in each run's lineage (for add, its
    # steps outside the versions the rollback discarded, whose sessions were released and
    # trained again) each in one step, and the server counts exactly those as consumed
    discarded = range(source + 1, rollback["from"] + 1)
    trained = {
        name: [
            session
            for record in records[name]
            if not (name == "add" and record["version"] in discarded)
            for session in record["session_ids"]
        ]
        for name in records
    }
    assert not set(trained["add"]) & set(trained["sub"])
    for name, run in (("add", add), ("sub", sub)):
        assert len(trained[name]) == len(set(trained[name])), name
        assert run["server"]["sessions"].get("consumed") == len(trained[name]), run["server"]
        assert run["sessions_trained"] == len(trained[name]), run
