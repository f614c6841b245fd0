"""The demo, end to end and for real: `proxrl demo` in a short mode raises the mean reward, and
evaluates its held-out and seen sets by policy version as the server charts them.

The whole loop runs as a user runs it: the warm-up (cached under .proxrl-cache, as `make
demo` caches it), `proxrl serve` with its embedded engine, `proxrl train` on Ray with decoupled
PPO at max_staleness 2, and the math agent's concurrent sessions through the openai SDK. Ctrl-C
(SIGINT) ends it part-way, as a user would: it must stop cleanly, leave nothing running, and
still write its summary and plot.

The gain is read from the trainer's own record (metrics.jsonl: each step's mean reward over its
64 sessions): the mean of the first 20 steps against the mean of the last 20, 1,280 sessions of
160 problems each. The summary's own start and end (256 sessions, only 32 problems in GRPO
groups of 8) are for the eye: one window's mean has a standard deviation near 0.07, too wide
to test a 0.1 gain on. Numbers seen in three CI-like runs on this 2-core machine (seed 0,
240 s of training, 122-144 steps): first 20 steps 0.63-0.65, last 20 0.82-0.85, gain
0.17-0.22; a 20-step mean varies by about 0.02 (step rewards' spread 0.08-0.10 over the
square root of 20), so the asked-for +0.10 sits more than 3 standard deviations of the
difference below what runs reach. The summary's windows in those runs went 0.69 -> 0.78-0.89.
Since then the warm-up was rebuilt (its cache key follows the source of the tiny model's
builder, which changed on 2026-11-24) and the warmed model starts lower: it samples the right
sum 0.45 of the time (the 100 problems, 8 samples each), not about 2 in 3. Two runs on
2026-11-24, with the held-out problems left out of training and the machine loaded by other
work (67 and 71 steps), went 0.40 -> 0.61 and 0.42 -> 0.66 over the first and last 20 steps
(gain 0.21 and 0.24).

The evaluation sets (examples/agents/heldout.py: 32 problems held out of training, 32 seen in
it) are checked for what they must hold, not for a gain: greedy accuracy on 32 problems moves
in steps of 1/32, and on the held-out set it does not rise on this task (the tiny model learns
each sum it practises: held-out 0.66 -> 0.63 in both runs, one evaluation to the next moving by
up to 0.09, while the seen set went 0.53 -> 0.97 in the second). They must be evaluated at
version 0, every --eval-every versions beside training, and once more at the last version
after the trainer stopped (Ctrl-C included), and their accuracy per answering version must be
exactly what the server reports in GET /rl/runs/{id}.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.support import ROOT, command_of, descendants, kill_all, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_S = 240.0  # seconds of training before Ctrl-C
MIN_GAIN = 0.10  # last WINDOW_STEPS steps' mean reward over the first WINDOW_STEPS'
WINDOW_STEPS = 20
EVAL_EVERY = 20  # versions; the run has at least 2 * WINDOW_STEPS, so one falls mid-run


def test_the_demo_raises_the_reward_and_stops_cleanly_on_ctrl_c(tmp_path):
    out = tmp_path / "demo"
    log = (tmp_path / "demo.log").open("w")
    arguments = ["--out", str(out), "--seed", "0", "--eval-every", str(EVAL_EVERY)]
    arguments.append("--no-keep-serving")  # exit after the summary even when run at a terminal
    demo = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "demo", *arguments],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "120"},
        # Ctrl-C must reach it even where this test runs with SIGINT ignored (as a background
        # job of a non-interactive shell is): Python then leaves it ignored in the child too.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    children: list[int] = []
    try:
        metrics = out / "trainer" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not metrics.exists():  # the warm-up, the server and the trainer's workers start
            assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer never finished a step"
            time.sleep(1)
        time.sleep(TRAIN_S)
        children = descendants(demo.pid)
        assert children, "the demo runs the server, engine and trainer as child processes"
        demo.send_signal(signal.SIGINT)
        assert demo.wait(180) == 130
    finally:
        if demo.poll() is None:  # the test failed: leave nothing running behind it
            stragglers = descendants(demo.pid)
            demo.kill()
            demo.wait(30)
            kill_all(stragglers)
        log.close()
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"left running after Ctrl-C: {[command_of(pid) for pid in alive]}"

    summary = json.loads((out / "summary.json").read_text())
    for key in ("reward_start", "reward_end", "versions_published", "sessions_trained", "seconds"):
        assert key in summary
    assert 0.0 <= summary["reward_start"] <= 1.0 and 0.0 <= summary["reward_end"] <= 1.0
    assert summary["versions_published"] >= 10, summary
    assert summary["sessions_trained"] >= 10 * 64, summary
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) >= 2 * WINDOW_STEPS, len(steps)
    rewards = [step["reward_mean"] for step in steps]
    first = statistics.mean(rewards[:WINDOW_STEPS])
    last = statistics.mean(rewards[-WINDOW_STEPS:])
    assert last - first >= MIN_GAIN, (first, last, summary)
    assert max(step["staleness_max"] for step in steps) >= 1  # asynchronous: stale tokens trained
    check_evaluation_set(summary, "heldout")
    check_evaluation_set(summary, "seen")


def check_evaluation_set(summary: dict, task_id: str) -> None:
    figures = summary[task_id]
    problems, evaluations = figures["problems"], figures["evaluations"]
    assert problems == 32 and figures["task_id"] == task_id, figures
    assert all(e["count"] == problems for e in evaluations), evaluations
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evaluations), evaluations
    # the first before training moved; the last after the trainer stopped, all at its version
    assert figures["first"] == evaluations[0] and figures["first"]["versions"] == [0, 0]
    final = summary["versions_published"]
    assert figures["last"] == evaluations[-1] and figures["last"]["versions"] == [final, final]
    assert figures["best"]["accuracy"] == max(e["accuracy"] for e in evaluations)
    middle = evaluations[1:-1]
    assert middle, "no evaluation ran beside training"
    assert all(EVAL_EVERY <= e["versions"][0] <= final for e in middle), evaluations
    ours = figures["by_version"]
    assert len(ours) >= 2 and sum(row["count"] for row in ours) == problems * len(evaluations)
    theirs = figures["server_by_version"]
    assert [(row["version"], row["count"]) for row in ours] == [
        (row["version"], row["count"]) for row in theirs
    ], (ours, theirs)
    for mine, server in zip(ours, theirs, strict=True):
        assert mine["mean"] == pytest.approx(server["mean"], abs=1e-12), (mine, server)
    assert figures["server_agrees"] is True
