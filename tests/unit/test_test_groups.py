"""`make test-slow` relies on ``--dist loadgroup`` keeping a group on one worker
(tests/conftest.py): the real-agent lane shares one server and one fixed folder, and the training
tests share a core. No test was ever grouped: xdist's hook, which reads the markers, ran before
ours, which sets them (ours is now tryfirst); and pytest 9.2 with pytest-xdist 3.8 groups nothing
anyway (xdist writes the group into a node id that pytest 9.2 no longer reads: the lock holds
pytest below 9.2). So the lane's files ran on both workers, each setting up the lane in the same
folder, and CI failed on the race. This runs our hook on a small suite laid out like ours, on 2
workers, and checks where each test ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RECORD = """import json, os, time

def test_{name}(request):
    time.sleep(0.3)  # long enough that both workers take tests while the suite runs
    with open({out!r}, "a") as out:
        out.write(json.dumps([request.node.nodeid, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""

# a file of the suite -> the group tests/conftest.py gives it
FILES = {
    "tests/agents/test_claude_code.py": "agents",
    "tests/agents/test_codex.py": "agents",
    "tests/agents/test_qwen_code.py": "agents",
    "tests/e2e/test_demo_learns.py": "training",
    "tests/integration/test_trainer_loop.py": "training",
    "tests/reliability/test_drill_a.py": "tests/reliability/test_drill_a.py",
    "tests/reliability/test_drill_b.py": "tests/reliability/test_drill_b.py",
}


@pytest.mark.timeout(120)
def test_each_group_of_the_slow_lane_runs_on_one_worker(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    out = tmp_path / "ran.jsonl"
    for path in FILES:
        (suite / path).parent.mkdir(parents=True, exist_ok=True)
        (suite / path).write_text(RECORD.format(name=Path(path).stem[5:], out=str(out)))
    # the project's own hook, as tests/conftest.py defines it
    (suite / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-n", "2", "--dist", "loadgroup", "--rootdir", str(suite), "tests"),
        ],
        cwd=suite,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(ran) == len(FILES)
    workers: dict[str, set[str]] = {}
    for nodeid, worker in ran:
        group = FILES[nodeid.split("::")[0]]
        assert nodeid.endswith(f"@{group}"), f"{nodeid} was not put in its group {group!r}"
        workers.setdefault(group, set()).add(worker)
    assert len(workers["agents"]) == 1 and len(workers["training"]) == 1, workers
