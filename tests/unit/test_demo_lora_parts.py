"""The two-run LoRA demo's pieces, without a server: its flags and their refusals, the second
task (subtraction), the problems a run practises, and what its table and summary make of a
rollback (the sessions trained into the lineage, the rolling reward around it)."""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from tests.support import ROOT


def load_demo_lora():
    """examples/demo_lora.py as a module; the paths it puts on sys.path are put back after."""
    if "proxrl_demo_lora" not in sys.modules:
        path = ROOT / "examples/demo_lora.py"
        spec = importlib.util.spec_from_file_location("proxrl_demo_lora", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["proxrl_demo_lora"] = module
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "path", list(sys.path))
            spec.loader.exec_module(module)
    return sys.modules["proxrl_demo_lora"]


demo_lora = load_demo_lora()
arithmetic, subtraction = demo_lora.arithmetic, demo_lora.subtraction


def test_the_defaults_roll_run_add_back_mid_way():
    args = demo_lora.parse_args([])
    assert args.rollback and (args.rollback_at, args.rollback_by) == (24, 12)
    assert (args.minutes, args.batch_size, args.lr, args.lora_rank) == (5.0, 32, 3e-3, 8)
    assert not demo_lora.parse_args(["--no-rollback"]).rollback


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--rollback-by", "0"], "--rollback-by"),
        (["--rollback-at", "5", "--rollback-by", "5"], "--rollback-by"),
        (["--problems", "0"], "--problems"),
        (["--problems", "51"], "--problems"),
        (["--lora-rank", "0"], "--lora-rank"),
        (["--batch-size", "12"], "multiples of --group-size"),
        (["--minutes", "0"], "--minutes"),
    ],
)
def test_bad_flags_are_refused_by_name(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo_lora.parse_args(flags)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@given(st.integers(0, 10_000))
def test_subtraction_problems_are_never_negative_and_their_worked_answer_earns_1(seed):
    for problem, _ in zip(subtraction.problems(seed), range(20), strict=False):
        high, low = problem.terms
        assert 0 <= low <= high <= 9 and problem.question == f"{high}-{low}="
        assert problem.task_id == f"sub-{high}-{low}"
        assert arithmetic.reward(problem, subtraction.solution(problem)) == 1.0
        assert arithmetic.reward(problem, f"{high}-{low}={high - low + 1}") == 0.0


def test_a_run_practises_its_first_distinct_problems_over_and_over():
    stream = demo_lora.practised(subtraction.problems(0), 16)
    first = [next(stream) for _ in range(16)]
    assert len({p.task_id for p in first}) == 16
    assert [next(stream).task_id for _ in range(32)] == [p.task_id for p in first] * 2


def lane_with(rewards: list[tuple[float, int, float]], rollbacks: list[dict], steps: list[dict]):
    """A lane whose agent saw ``rewards`` as (seconds, version, reward)."""
    lane = demo_lora.Lane("add", {"id": "run-add"})
    for at, version, reward in rewards:
        lane.board.outcomes.append(demo_lora.demo.Outcome(at, reward, version))
    lane.rollbacks, lane.board.steps = rollbacks, steps
    return lane


def test_a_rollback_leaves_its_discarded_steps_out_of_the_sessions_trained():
    rollback = {"from": 4, "source": 2, "version": 5, "at_s": 10.0}
    steps = [{"version": v, "sessions": 32} for v in (1, 2, 3, 4, 6, 7)]
    lane = lane_with([], [rollback], steps)
    assert lane.sessions_trained() == 4 * 32  # versions 3 and 4 were discarded
    assert lane_with([], [], steps).sessions_trained() == 6 * 32


def test_the_rollback_figures_are_rolling_rewards_around_it():
    window = demo_lora.WINDOW
    rollback = {"from": 4, "source": 2, "version": 5, "at_s": 2 * window - 0.5}
    rewards = [(float(i), 2, 0.0) for i in range(window)]  # under the source: all wrong
    rewards += [(float(window + i), 4, 1.0) for i in range(window)]  # before: all right
    rewards += [(float(2 * window + i), 5, 0.5) for i in range(window)]  # after: half
    lane = lane_with(rewards, [rollback], [])
    figures = lane.rollback_figures(rollback)
    assert figures == {"reward_before": 1.0, "reward_after": 0.5, "reward_at_source": 0.0}
    summary = demo_lora.summarize_run(lane)
    assert summary["rollbacks"] == [{**rollback, **figures}]
    assert summary["reward_start"] == 0.0 and summary["reward_end"] == 0.5
    assert (
        lane_with(rewards[: 2 * window + 3], [rollback], []).rollback_figures(rollback)[
            "reward_after"
        ]
        is None
    )  # not yet WINDOW sessions after it


def test_the_table_before_any_data_and_with_a_rollback():
    args = demo_lora.parse_args([])
    lanes = [
        lane_with([], [{"from": 24, "source": 12, "version": 25, "at_s": 1.0}], []),
        demo_lora.Lane("sub", {"id": "run-sub"}),
    ]
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(demo_lora.table(lanes, lanes[0].board.started, args))
    text = console.export_text()
    assert "v24 → v25 (serves v12)" in text
    assert demo_lora.demo.NO_DATA in text
