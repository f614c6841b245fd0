"""bench/staleness_sim.py on a small budget, through its command line: the grid runs, writes its
table and plot, and today's policy shows what the audit measured (groups of 4 lose far more of
what was sampled than groups of 1; the admission bound leaks, so the admitted-but-untrained
backlog outgrows (eta + 1) * batch_size)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BATCH, ETA, STEPS = 16, 2, 80


def test_groups_of_four_lose_far_more_and_the_bound_leaks(tmp_path):
    command = [
        sys.executable, "bench/staleness_sim.py", "--groups", "1,4", "--etas", str(ETA),
        "--seeds", "2", "--steps", str(STEPS), "--batch-size", str(BATCH),
        "--results-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "staleness-sim.md").read_text()
    assert (tmp_path / "staleness-sim.png").stat().st_size > 10_000
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "current":
            rows[int(cells[1])] = cells
    assert set(rows) == {1, 4}

    def first(text: str) -> float:
        return float(re.match(r"[0-9.]+", text).group())

    trained = {g: first(rows[g][3]) for g in rows}
    dropped = {g: first(rows[g][4]) for g in rows}
    backlog = {g: first(rows[g][8]) for g in rows}
    assert trained[1] > 60 and trained[4] < 40 and trained[1] - trained[4] > 30, trained
    assert dropped[1] < 5 < 50 < dropped[4], dropped
    assert backlog[1] <= (ETA + 1) * BATCH  # nothing dropped: the bound holds
    assert backlog[4] > 3 * (ETA + 1) * BATCH, backlog  # drops leave the count: it leaks
    kept, sampled = (float(x) for x in rows[4][7].split("/"))
    assert kept > sampled + 1  # the survivors are the long sessions
