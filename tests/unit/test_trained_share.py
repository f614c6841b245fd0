"""What the trainer follows of the run's config (trainer/loop.py `follow`), and what of the
sampled tokens trains: the step's and the run's trained share (trainer/figures.py), kept across a
checkpoint (trainer/checkpoint.py), the warning below min_trained_share, and the line of a batch
that trains nothing. The server's view of the same figures (server/rl/runs.py `training_view`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from server.rl.runs import training_view
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.config import AlgorithmConfig
from trainer.figures import (
    Phases,
    Progress,
    add_to_totals,
    reason_codes,
    share_warning,
    step_record,
    totals,
)
from trainer.loop import Followed, follow_run, followed_from, nothing_to_train
from trainer.rollouts import ALTERNATIVE, OFF_TEMPERATURE, STALE, Batch, Sample

RUN = {"temperature": 1.0, "off_temperature": "mask", "group_size": 4, "max_staleness": 1}


def followed(batch_size: int = 8, max_staleness: int = 1) -> Followed:
    return Followed(follow_run(AlgorithmConfig(), RUN), batch_size, max_staleness)


# ----- following the run's batch size and staleness bound -------------------------------------


def test_the_run_s_batch_size_and_max_staleness_are_followed_and_named_as_changes():
    current = followed()
    new, refused = followed_from(
        current, AlgorithmConfig(), {**RUN, "batch_size": 12, "max_staleness": 3}
    )
    assert refused is None
    assert (new.batch_size, new.max_staleness) == (12, 3)
    assert current.changes(new) == {"batch_size": 12, "max_staleness": 3}
    same, _ = followed_from(new, AlgorithmConfig(), {**RUN, "batch_size": 12, "max_staleness": 3})
    assert new.changes(same) == {}


def test_a_batch_size_that_is_not_a_multiple_of_the_group_keeps_the_last_valid_one():
    new, refused = followed_from(followed(8), AlgorithmConfig(), {**RUN, "batch_size": 10})
    assert new.batch_size == 8
    assert refused is not None and "batch_size 10" in refused and "group_size 4" in refused


def test_an_unset_batch_size_admission_off_keeps_the_last_one():
    new, refused = followed_from(followed(8), AlgorithmConfig(), {**RUN, "batch_size": None})
    assert (new.batch_size, refused) == (8, None)


def test_a_temperature_change_is_named_with_the_pace_unchanged():
    new, _ = followed_from(
        followed(8), AlgorithmConfig(), {**RUN, "temperature": 0.5, "batch_size": 8}
    )
    assert followed(8).changes(new) == {"temperature": 0.5}


# ----- the step's and the run's trained share ---------------------------------------------------


def sample(mask: list[int]) -> Sample:
    return Sample("s", [1] * len(mask), mask, [0.0] * len(mask), [0] * len(mask), [0.5] * len(mask))


def make_batch() -> Batch:
    """6 trained tokens, 4 masked (stale 1, off-temperature 2, alternative 1), 10 in dropped
    sessions: 20 sampled."""
    batch = Batch(
        samples=[sample([0, 1, 1, 1]), sample([1, 1, 1])],
        session_ids=["a", "b", "c", "d", "e"],
        dropped={"c": "stale: 3 behind", "d": "no_contrast: same rewards", "e": "stale: 2"},
        rewards=[1.0, 0.0],
        staleness=[0] * 6,
        masked=Counter({STALE: 1, OFF_TEMPERATURE: 2, ALTERNATIVE: 1}),
    )
    batch.dropped_tokens = 10
    return batch


def test_a_step_records_what_it_sampled_trained_masked_and_dropped():
    batch = make_batch()
    assert batch.sampled_tokens == 20
    state = TrainerState(step=1, version=1)
    add_to_totals(state, batch)
    record = step_record(state, batch, {}, Phases(0.0, 0.0))
    assert record["sampled_tokens"] == 20 and record["trained_tokens"] == 6
    assert record["trained_share"] == pytest.approx(0.3)
    assert record["masked_tokens"] == {ALTERNATIVE: 1, OFF_TEMPERATURE: 2, STALE: 1}
    assert record["dropped_tokens"] == 10
    assert (record["dropped_stale"], record["dropped_no_contrast"]) == (2, 1)
    assert record["total_sampled_tokens"] == 20 and record["total_trained_tokens"] == 6
    assert record["total_trained_share"] == pytest.approx(0.3)
    assert record["total_dropped_sessions"] == {"stale": 2, "no_contrast": 1}
    json.dumps(record)


def test_the_reward_figure_is_the_undiscounted_outcome_and_the_return_its_own_figure():
    """A 3-turn success at discount 0.9 reads reward 1.0; its first turn's return is 0.81."""
    batch = Batch([], session_ids=["a", "b"], rewards=[1.0, 0.0], returns=[0.81, 0.0])
    record = step_record(TrainerState(step=1), batch, {}, Phases(0.0, 0.0))
    assert record["reward_mean"] == 0.5 and record["return_mean"] == pytest.approx(0.405)


def test_nothing_sampled_is_a_share_of_one():
    empty = Batch([], session_ids=[])
    record = step_record(TrainerState(step=1), empty, {}, Phases(0.0, 0.0))
    assert record["trained_share"] == 1.0 and record["total_trained_share"] == 1.0


def test_the_run_s_totals_add_up_every_batch_trained_or_not():
    state = TrainerState()
    add_to_totals(state, make_batch())
    nothing = Batch([], session_ids=["x", "y"], dropped={"x": "no_turns: -", "y": "stale: 9"})
    nothing.dropped_tokens = 5
    add_to_totals(state, nothing)
    assert (state.total_sampled_tokens, state.total_trained_tokens) == (25, 6)
    assert state.total_trained_share == pytest.approx(6 / 25)
    assert state.total_masked_tokens == {STALE: 1, OFF_TEMPERATURE: 2, ALTERNATIVE: 1}
    assert state.total_dropped_sessions == {"stale": 3, "no_contrast": 1, "no_turns": 1}


def test_the_totals_are_restored_with_the_checkpoint_and_grow_from_there(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    state = TrainerState(run_id="run-1", step=3, version=3)
    add_to_totals(state, make_batch())
    path = checkpoints.path(3)
    path.mkdir()
    checkpoints.commit(path, state)
    _, restored = checkpoints.latest()  # type: ignore[misc]
    assert totals(restored) == totals(state)
    add_to_totals(restored, make_batch())  # what the resumed trainer trains again
    assert (restored.total_sampled_tokens, restored.total_trained_tokens) == (40, 12)
    assert restored.total_dropped_sessions == {"stale": 4, "no_contrast": 2}


def test_a_checkpoint_from_before_the_totals_resumes_with_none_counted():
    old = TrainerState.from_json({"run_id": "r", "step": 2, "version": 2})
    assert old.total_sampled_tokens == 0 and old.total_trained_share == 1.0
    assert old.total_masked_tokens == {} and old.total_dropped_sessions == {}


def test_the_warning_names_the_biggest_causes_below_the_share_only():
    state = TrainerState()
    add_to_totals(state, make_batch())  # 30% trained
    warning = share_warning(state, 0.9)
    assert warning is not None and "30%" in warning and "min_trained_share 0.9" in warning
    assert "2 tokens masked as off_temperature" in warning
    assert "2 sessions dropped as stale" in warning
    assert share_warning(state, 0.3) is None  # at the level: no warning
    assert share_warning(state, 0.0) is None


def test_the_progress_line_shows_the_step_s_trained_share(tmp_path, caplog):
    progress = Progress(max_steps=1, first_step=0, path=tmp_path / "metrics.jsonl")
    with caplog.at_level(logging.INFO, logger="proxrl.trainer"):
        progress.step(TrainerState(step=1, version=1), make_batch(), {}, Phases(0.0, 0.0))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1")]
    assert "6 tokens (trained 30%," in line


def test_a_batch_that_trains_nothing_says_why_and_that_it_is_no_step():
    nothing = Batch([], session_ids=["x", "y", "z"], dropped=dict.fromkeys("xyz", "stale: 9"))
    nothing.dropped["z"] = "no_turns: none"
    assert nothing_to_train(nothing) == (
        "nothing to train in 3 sessions (2 stale, 1 no_turns); not counted as a step"
    )
    assert reason_codes(nothing.dropped.values()) == {"stale": 2, "no_turns": 1}


# ----- the server's view ------------------------------------------------------------------------


def test_the_run_view_takes_the_latest_step_s_totals_and_warns_below_the_level():
    state = TrainerState()
    add_to_totals(state, make_batch())
    dropped = {"stale": 2, "no_contrast": 1, "no_turns": 7}
    view = training_view(totals(state), dropped, 0.9)
    assert view.total_trained_share == pytest.approx(0.3)
    assert view.dropped_sessions == dropped and view.min_trained_share == 0.9
    assert view.warning is not None and "7 sessions dropped as no_turns" in view.warning
    assert "2 tokens masked as off_temperature" in view.warning
    assert training_view(totals(state), dropped, 0.25).warning is None
    before = training_view(None, {}, 0.9)  # no step yet: no totals, no warning
    assert before.total_trained_share is None and before.warning is None
