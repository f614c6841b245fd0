"""What the trainer follows of the run's config (trainer/loop.py `follow`), and what of the
sampled tokens trains: the step's and the run's trained share (trainer/figures.py), kept across a
checkpoint (trainer/checkpoint.py), the warning below min_trained_share, and the line of a batch
that trains nothing. The server's view of the same figures (server/rl/runs.py `training_view`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter

import pytest

from server.common import trained_share
from server.rl.runs import training_view
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.claims import Claim
from trainer.config import AlgorithmConfig, load_config
from trainer.figures import (
    BEHAVIOUR_CAP,
    Phases,
    Progress,
    add_to_totals,
    reason_codes,
    share_warning,
    step_record,
    totals,
)
from trainer.loop import Claimed, Followed, Trainer, follow_run, followed_from, nothing_to_train
from trainer.rollouts import ALTERNATIVE, OFF_TEMPERATURE, STALE, Batch, Sample, Tally
from trainer.server_api import ServerError

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
    add_to_totals(state, batch, {})
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
    add_to_totals(state, make_batch(), None)
    nothing = Batch([], session_ids=["x", "y"], dropped={"x": "no_turns: -", "y": "stale: 9"})
    nothing.dropped_tokens = 5
    add_to_totals(state, nothing, None)
    assert (state.total_sampled_tokens, state.total_trained_tokens) == (25, 6)
    assert state.total_trained_share == pytest.approx(6 / 25)
    assert state.total_masked_tokens == {STALE: 1, OFF_TEMPERATURE: 2, ALTERNATIVE: 1}
    assert state.total_dropped_sessions == {"stale": 3, "no_contrast": 1, "no_turns": 1}


def test_the_totals_are_restored_with_the_checkpoint_and_grow_from_there(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    state = TrainerState(run_id="run-1", step=3, version=3)
    add_to_totals(state, make_batch(), None)
    path = checkpoints.path(3)
    path.mkdir()
    checkpoints.commit(path, state)
    _, restored = checkpoints.latest()  # type: ignore[misc]
    assert totals(restored) == totals(state)
    add_to_totals(restored, make_batch(), None)  # what the resumed trainer trains again
    assert (restored.total_sampled_tokens, restored.total_trained_tokens) == (40, 12)
    assert restored.total_dropped_sessions == {"stale": 4, "no_contrast": 2}


def test_a_checkpoint_from_before_the_totals_resumes_with_none_counted():
    old = TrainerState.from_json({"run_id": "r", "step": 2, "version": 2})
    assert old.total_sampled_tokens == 0 and old.total_trained_share == 1.0
    assert old.total_masked_tokens == {} and old.total_dropped_sessions == {}


def test_the_warning_names_the_biggest_causes_below_the_share_only():
    state = TrainerState()
    add_to_totals(state, make_batch(), None)  # 30% trained
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
    add_to_totals(state, make_batch(), None)
    dropped = {"stale": 2, "no_contrast": 1, "no_turns": 7}
    view = training_view(totals(state), dropped, 0.9)
    assert view.total_trained_share == pytest.approx(0.3)
    assert view.dropped_sessions == dropped and view.min_trained_share == 0.9
    assert view.warning is not None and "2 sessions dropped as stale" in view.warning
    assert "2 tokens masked as off_temperature" in view.warning
    assert training_view(totals(state), dropped, 0.25).warning is None
    before = training_view(None, {}, 0.9)  # no step yet: no totals, no warning
    assert before.total_trained_share is None and before.warning is None


# ----- what the loss masks above the behaviour cap ----------------------------------------------


def test_tokens_the_loss_masked_above_the_behaviour_cap_are_masked_not_trained():
    """Under stale=keep the workers count the tokens whose behaviour weight is above the cap
    (token_mask, sequence_mask); they leave the loss, so they are masked (behaviour_cap)."""
    batch = make_batch()  # 6 loss tokens, 20 sampled
    stats = {"behaviour_masked_tokens": 2.0, "tokens": 6.0, "seconds": 1.0}
    state = TrainerState(step=1, version=1)
    add_to_totals(state, batch, stats)
    record = step_record(state, batch, stats, Phases(0.0, publish=0.5))
    assert record["trained_tokens"] == 4 and record["sampled_tokens"] == 20
    assert record["trained_share"] == pytest.approx(4 / 20)
    assert record["masked_tokens"] == {
        ALTERNATIVE: 1,
        BEHAVIOUR_CAP: 2,
        OFF_TEMPERATURE: 2,
        STALE: 1,
    }
    masked = sum(record["masked_tokens"].values())
    assert record["trained_tokens"] + masked + record["dropped_tokens"] == record["sampled_tokens"]
    assert (state.total_trained_tokens, state.total_masked_tokens[BEHAVIOUR_CAP]) == (4, 2)
    assert record["total_trained_share"] == pytest.approx(4 / 20)
    # the pace is over what the update processed, the masked tokens included
    assert record["tokens_per_second"] == pytest.approx(6 / 1.5)


def test_a_batch_that_trained_nothing_has_no_stats_and_masks_nothing_in_the_loss():
    state = TrainerState()
    nothing = Batch([], session_ids=["x"], dropped={"x": "stale: 9"})
    nothing.dropped_tokens = 4
    add_to_totals(state, nothing, None)
    assert (state.total_sampled_tokens, state.total_trained_tokens) == (4, 0)
    assert state.total_masked_tokens == {} and state.total_dropped_sessions == {"stale": 1}


# ----- a batch that trains nothing: the last record again, with the totals --------------------


def test_the_last_step_is_posted_again_with_the_totals_of_a_batch_that_trained_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    progress = Progress(max_steps=0, first_step=0, path=path)
    posted: list[dict] = []
    tracked: list[dict] = []
    progress.amend_totals(TrainerState())  # no step yet: nothing to amend, nothing posted
    progress.report, progress.track = posted.append, tracked.append
    state = TrainerState(step=1, version=1)
    add_to_totals(state, make_batch(), {})
    progress.step(state, make_batch(), {}, Phases(0.0, 0.0))
    nothing = Batch([], session_ids=["x"], dropped={"x": "stale: 9"})
    nothing.dropped_tokens = 10
    add_to_totals(state, nothing, None)
    progress.amend_totals(state)
    assert [(r["step"], r["version"]) for r in posted] == [(1, 1), (1, 1)]
    assert posted[1]["total_sampled_tokens"] == 30 and posted[1]["trained_share"] == 0.3
    assert posted[1]["total_trained_share"] == pytest.approx(6 / 30)
    assert posted[1]["total_dropped_sessions"] == {"stale": 3, "no_contrast": 1}
    assert len(tracked) == 1 and len(path.read_text().splitlines()) == 1  # the step's own only
    progress.stopped()  # a stop after it carries the totals too
    assert posted[2]["total_sampled_tokens"] == 30 and "stopped_at" in posted[2]


def test_the_warning_is_the_servers_text_from_the_run_s_totals():
    state = TrainerState()
    add_to_totals(state, make_batch(), None)
    assert share_warning(state, 0.9) == trained_share.share_warning(
        0.3, 20, state.total_masked_tokens, state.total_dropped_sessions, 0.9
    )


# ----- drops across a restart, and the claims of a batch that trained nothing ------------------


class RecordingServer:
    """The calls of `trainer.server_api.ServerAPI` the trainer makes here, answered as the
    server would for sessions it holds, and recorded; ``fail`` names calls that raise."""

    url = "http://server"

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def _call(self, name: str, claim_id: str) -> None:
        self.calls.append((name, claim_id))
        if name in self.fail:
            raise ServerError(f"{name} refused")

    def run(self, run_id: str) -> dict:
        config = {**RUN, "batch_size": 2, "min_trained_share": 0.9}
        return {"id": run_id, "model_path": "/no/model", "policy_version": 0, "config": config}

    def clone(self, retries: int = 0) -> RecordingServer:
        return self

    def close(self) -> None:
        pass

    def release(self, claim_id: str) -> int:
        self._call("release", claim_id)
        return 0

    def drop(self, claim_id: str, dropped: dict[str, str]) -> dict:
        self._call("drop", claim_id)
        return {"dropped": len(dropped), "held": 0}

    def confirm(self, claim_id: str, dropped: dict[str, str] | None = None) -> dict:
        self._call("confirm", claim_id)
        return {"settled": len(dropped or {})}

    def post_step(self, run_id: str, step: int, version: int, metrics: dict) -> None:
        self.calls.append(("post_step", str(step)))


def trainer(tmp_path, server: RecordingServer) -> Trainer:
    config = load_config(None, ["run_id=run-1", f"output_dir={tmp_path}", "model=/no/model"])
    return Trainer(config, server)  # type: ignore[arg-type]


def all_dropped(claim_id: str) -> tuple[Claimed, Batch]:
    """A claim of two sessions that trained nothing: 5 tokens dropped as stale, 3 masked."""
    batch = Batch([], session_ids=["x", "y"], dropped={"x": "stale: 9", "y": "no_turns: -"})
    batch.tallies = {"x": Tally(Counter({ALTERNATIVE: 3}), 5), "y": Tally()}
    batch.masked, batch.dropped_tokens = Counter({ALTERNATIVE: 3}), 5
    return Claimed([Claim(claim_id, ["x", "y"])]), batch


def test_a_journalled_drop_is_kept_until_a_checkpoint_holds_it(tmp_path):
    store = Checkpoints(tmp_path, keep=2)
    store.journal_claim("c1", 0, 2)
    tally = {"dropped_tokens": 5, "masked_tokens": {ALTERNATIVE: 3}, "dropped_sessions": {}}
    store.journal_drops("c1", tally)
    store.journal_republish(1, 2)
    assert store.journalled() == ["c1"] and store.journalled_drops() == {"c1": tally}
    store.clear_journal(republished=[[1, 2]], drops={"c1": tally})  # a restart counted it
    assert store.journalled() == [] and store.journalled_drops() == {"c1": tally}
    assert store.journalled_republishes() == [[1, 2]]
    store.clear_journal()  # a checkpoint holds it
    assert store.journalled_drops() == {}


def test_a_restart_counts_the_drops_its_checkpoint_does_not_cover(tmp_path):
    """Sessions dropped after the last checkpoint were told to the server and are never
    claimed again: their tokens and reasons go back into the restored totals, once."""
    server = RecordingServer()
    first = trainer(tmp_path, server)
    for claim_id in ("covered", "lost"):  # both dropped and told; one checkpoint covers one
        claimed, batch = all_dropped(claim_id)
        first.checkpoints.journal_claim(claim_id, 0, 2)
        first.drop(claimed, batch)
    state = TrainerState(run_id="run-1", step=1, version=0, total_sampled_tokens=8)
    state.covered_claims = [{"claim_id": "covered", "sessions": 2, "dropped": batch.dropped}]
    state.total_dropped_sessions = {"stale": 1, "no_turns": 1}
    path = first.checkpoints.path(1)
    path.mkdir()
    first.checkpoints.commit(path, state)

    for restart in range(2):  # a second crash before a checkpoint loses nothing either
        again = trainer(tmp_path, server)
        again.state = TrainerState.from_json(dataclasses.asdict(state))
        again._settle_journal()
        assert again.state.total_sampled_tokens == 8 + 8, restart
        assert again.state.total_masked_tokens == {ALTERNATIVE: 3}
        assert again.state.total_dropped_sessions == {"stale": 2, "no_turns": 2}
    assert ("release", "lost") in server.calls and ("confirm", "covered") in server.calls


def test_the_claims_of_a_batch_that_trained_nothing_are_confirmed_at_once(tmp_path, caplog):
    server = RecordingServer(fail=("drop",))  # the drop fails: the confirm settles them
    loop = trainer(tmp_path, server)
    progress = Progress(max_steps=0, first_step=0, path=tmp_path / "metrics.jsonl")
    claimed, batch = all_dropped("c1")
    loop.checkpoints.journal_claim("c1", 0, 2)
    with caplog.at_level(logging.WARNING, logger="proxrl.trainer"):
        told = loop.drop(claimed, batch)
        loop.train_nothing(claimed, batch, told, progress)
    assert ("confirm", "c1") in server.calls and loop.pending == []
    assert loop.state.total_sampled_tokens == 8 and loop.state.total_trained_share == 0.0
    assert loop.checkpoints.journalled_drops()["c1"]["dropped_tokens"] == 5  # told by the confirm
    assert any("only 0% of the 8 tokens" in r.getMessage() for r in caplog.records)

    refused = RecordingServer(fail=("drop", "confirm"))  # kept for the next checkpoint
    loop = trainer(tmp_path / "refused", refused)
    loop.checkpoints.journal_claim("c2", 0, 2)
    claimed, batch = all_dropped("c2")
    loop.train_nothing(claimed, batch, loop.drop(claimed, batch), progress)
    assert [c.claim_id for c in loop.pending] == ["c2"]
    assert loop.checkpoints.journalled_drops() == {}  # the server knows nothing yet
