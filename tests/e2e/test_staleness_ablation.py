"""bench/staleness_ablation.py end to end on a tiny budget, so that it cannot rot: one seed,
max staleness 0 and 2, both objectives, a few steps. It checks that the report and the picture
are written and that the numbers add up (cells, steps, versions, achieved staleness within its
bound); with four steps of eight sessions it cannot say whether anything learned, and does not
try."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

# The first run warms the model up (cached under .proxrl-cache); the grid itself takes ~3 min.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 4
BATCH = 8
STALENESS = (0, 2)
HELD_OUT = 8


def test_staleness_ablation_runs_end_to_end(tmp_path):
    out, results = tmp_path / "cells", tmp_path / "results"
    command = [
        sys.executable, "bench/staleness_ablation.py",
        "--staleness", ",".join(map(str, STALENESS)), "--seeds", "0",
        "--steps", str(STEPS), "--batch-size", str(BATCH), "--group-size", "4",
        "--final-steps", "2", "--smooth", "2", "--held-out", str(HELD_OUT),
        "--max-concurrency", "64", "--mode-timeout", "240",
        "--out-dir", str(out), "--results-dir", str(results),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    # η=0 once (plain PPO stands for both), η=2 with each objective.
    assert [(c["cell"]["staleness"], c["cell"]["algorithm"]) for c in cells] == [
        (0, "plain"),
        (2, "decoupled"),
        (2, "plain"),
    ]
    for cell in cells:
        eta = cell["cell"]["staleness"]
        assert len(cell["rewards"]) == STEPS
        assert all(0.0 <= reward <= 1.0 for reward in cell["rewards"])
        assert cell["final_version"] >= STEPS
        assert 0 <= cell["staleness_mean"] <= cell["staleness_max"] <= eta
        assert cell["concurrency"] == (eta + 1) * BATCH
        assert cell["trained_tokens"] > 0 and cell["wall_s"] > 0
        # what did not train, beside the achieved staleness: the default stale=keep masks none
        assert cell["stale_tokens"] == 0 and cell["dropped_sessions"] >= 0
        assert cell["sampled_tokens"] >= cell["trained_tokens"] > 0
        # every problem of both evaluation sets answered once, by the final version
        for accuracy in (cell["held_out"], cell["seen"]):
            correct = accuracy * HELD_OUT
            assert 0 <= correct <= HELD_OUT and abs(correct - round(correct)) < 1e-9
        assert cell["evaluated_at_final"] == 2 * HELD_OUT
    assert "[3/3] eta2-plain-seed0" in done.stdout

    (report,) = results.glob("staleness-ablation-*.md")
    text = report.read_text()
    for row in ("| 0 | sync (both) |", "| 2 | decoupled |", "| 2 | plain |"):
        assert row in text
    assert "| stale tokens | dropped sessions |" in text
    assert "decoupled PPO, max staleness 2" in text and "plain PPO, max staleness 2" in text
    picture = results / "staleness-ablation.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < picture.stat().st_size < 200_000
