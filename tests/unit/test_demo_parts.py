"""The demo's pieces a person reads, without a server: the live table before any data, the
summary's and the plot's word on the held-out line, the dashboard line, and when the demo keeps
its server up at the end (a demo that ended by itself, never after a Ctrl-C)."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from tests.support import ROOT


def load_demo():
    """examples/demo.py as a module; the path it puts examples/agents on is put back after."""
    if "proxrl_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("proxrl_demo", ROOT / "examples/demo.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["proxrl_demo"] = module
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "path", list(sys.path))
            spec.loader.exec_module(module)
    return sys.modules["proxrl_demo"]


demo = load_demo()
heldout = demo.heldout  # examples/agents/heldout.py, as the demo imports it


def recording(width: int) -> Console:
    """A console that keeps what it prints, for export_text, and writes nowhere."""
    return Console(record=True, width=width, file=io.StringIO())


def rendered(renderable) -> str:
    console = recording(200)
    console.print(renderable)
    return console.export_text()


def answers(version: int, heldout_right: int, seen_right: int) -> list:
    problem = ("1+1=", "2")
    return [
        heldout.Answer(task_id, problem, "", float(i < right), version)
        for task_id, right in ((heldout.HELDOUT, heldout_right), (heldout.SEEN, seen_right))
        for i in range(4)
    ]


def test_the_live_table_shows_a_dash_until_there_is_data():
    args = demo.parse_args(["--no-keep-serving"])
    text = rendered(demo.table(demo.Board(), args))
    assert "0.000" not in text, text
    cells = [line.strip("│ ").split(" │ ") for line in text.splitlines() if " │ " in line]
    values = {name.strip(): value.strip() for name, value in cells}
    assert values.pop("policy version") == "0"  # version 0 is a fact, not a missing figure
    assert values.pop("held-out accuracy (greedy)").startswith("(the first evaluation")
    assert values.pop("seen accuracy (greedy)").startswith("(the first evaluation")
    assert len(values) == 6 and set(values.values()) == {demo.NO_DATA}, values
    board = demo.Board()
    board.add(1.0)
    board.add(0.0)
    board.steps = [
        {"sessions": 64, "tokens_per_second": 812.4, "staleness_mean": 0.5, "staleness_max": 2}
    ]
    text = rendered(demo.table(board, args))
    assert "0.500" in text and "812" in text and "0.50 / 2" in text and demo.NO_DATA not in text


def test_the_summary_and_the_plot_say_why_the_held_out_line_does_not_rise(tmp_path):
    board = demo.Board()
    for reward in (0.0, 1.0, 1.0, 1.0):
        board.add(reward)
    board.add_evaluation(answers(0, heldout_right=3, seen_right=2))
    board.add_evaluation(answers(5, heldout_right=2, seen_right=4))
    board.seconds = 12.0
    console = recording(400)
    demo.report(board, tmp_path, console)
    lines = console.export_text().splitlines()
    assert any(line.startswith("held-out accuracy") and "0.750" in line for line in lines)
    assert any(demo.HELDOUT_NOTE in line for line in lines), lines
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "not on held-out ones" in demo.HELDOUT_NOTE and "seen" in demo.HELDOUT_NOTE


def test_the_plot_carries_the_held_out_note(tmp_path, monkeypatch):
    import matplotlib.figure

    texts: list[str] = []
    original = matplotlib.figure.Figure.text
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "text",
        lambda self, x, y, s, *a, **k: texts.append(s) or original(self, x, y, s, *a, **k),
    )
    board = demo.Board()
    board.add(1.0)
    board.add_evaluation(answers(0, heldout_right=1, seen_right=1))
    demo.plot(board, tmp_path)
    assert texts == [demo.HELDOUT_NOTE]


def test_the_dashboard_line_names_the_address_and_the_admin_key():
    server = SimpleNamespace(url="http://127.0.0.1:8123", admin_key="k-123")
    line = demo.dashboard_line(server)
    assert "http://127.0.0.1:8123/admin" in line and "admin key k-123" in line


@pytest.mark.parametrize(
    ("argv", "tty", "keep"),
    [
        ([], True, True),  # a person at a terminal: look at the run afterwards
        ([], False, False),  # tests, CI, a pipe: exit as before
        (["--no-keep-serving"], True, False),
        (["--keep-serving"], False, True),
    ],
)
def test_the_server_stays_up_at_a_terminal_unless_told(argv, tty, keep, monkeypatch):
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: tty))
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(isatty=lambda: tty))
    assert demo.parse_args(argv).keep_serving is keep


def test_keeping_the_server_up_ends_when_the_server_does(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    server = SimpleNamespace(
        url="http://127.0.0.1:1", admin_key="k", process=process, log_path=tmp_path / "s.log"
    )
    console = recording(300)
    demo.serve_until_interrupted(server, console)
    text = console.export_text()
    assert "dashboard at http://127.0.0.1:1/admin" in text and "Ctrl-C to stop" in text
    assert "the server stopped by itself" in text


def stopped_server(tmp_path) -> SimpleNamespace:
    """A server whose process has ended: keeping it up returns at once."""
    process = SimpleNamespace(poll=lambda: 0)
    return SimpleNamespace(
        url="http://127.0.0.1:1", admin_key="k", process=process, log_path=tmp_path / "s.log"
    )


@pytest.mark.parametrize(
    ("keep_serving", "interrupted", "kept", "status"),
    [
        (True, False, True, 0),  # it ended by itself: the run stays on the dashboard
        (False, False, False, 0),
        (True, True, False, 130),  # a Ctrl-C (the first or the second) ends it after the summary
        (False, True, False, 130),
    ],
)
def test_the_server_stays_up_only_after_a_demo_that_ended_by_itself(
    keep_serving, interrupted, kept, status, tmp_path
):
    board = demo.Board()
    board.add(1.0)
    board.seconds = 3.0
    console = recording(300)
    server = stopped_server(tmp_path)
    assert demo.finish(board, tmp_path, console, server, keep_serving, interrupted) == status
    text = console.export_text()
    assert "reward " in text and (tmp_path / "summary.json").is_file()  # the summary, always
    assert ("Ctrl-C to stop" in text) is kept


def test_the_warm_up_cache_is_the_clones_by_default():
    """One definition (examples/agents/warm_start.py) for the demo and model init --warm-start."""
    assert demo.parse_args([]).cache == demo.CACHE_DIR == ROOT / ".proxrl-cache"
