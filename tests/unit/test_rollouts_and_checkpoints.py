"""Claimed sessions → samples: advantages over turn spans, temperature, alternatives,
staleness along the lineage, drop reasons instead of exceptions; and the checkpoint store."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.advantages import RunningBaseline
from trainer.checkpoint import Checkpoints, TrainerState, WrongCheckpoint
from trainer.config import AlgorithmConfig, ConfigError
from trainer.rollouts import ALTERNATIVE, GREEDY, OFF_TEMPERATURE, STALE, Rules, build_batch
from trainer.staleness import position, versions_behind

DROP_CODES = ("no_turns", "row_too_long", "stale", "no_trainable_tokens", "no_contrast")


def turn(versions, reward=None, glue=0, temperature=1.0, alternative=False, order=None):
    return dict(
        versions=versions,
        reward=reward,
        glue=glue,
        temperature=temperature,
        alternative=alternative,
        order=order,
    )


def row(prompt: int, turns: list[dict], row_index: int = 0, logprob: float = -0.5):
    """A stored row: ``prompt`` prompt tokens, then per turn its glue and its sampled tokens."""
    input_ids, mask, logprobs, versions, spans = [], [], [], [], []
    input_ids += [1] * prompt
    mask += [0] * prompt
    logprobs += [0.0] * prompt
    versions += [-1] * prompt
    for t in turns:
        input_ids += [2] * t["glue"]
        mask += [0] * t["glue"]
        logprobs += [0.0] * t["glue"]
        versions += [-1] * t["glue"]
        start = len(input_ids)
        input_ids += [3] * len(t["versions"])
        mask += [1] * len(t["versions"])
        logprobs += [logprob] * len(t["versions"])
        versions += t["versions"]
        span = {
            "completion_id": f"c{row_index}-{start}",
            "start": start,
            "end": len(input_ids),
            "reward": t["reward"],
            "temperature": t["temperature"],
            "alternative": t["alternative"],
        }
        if t["order"] is not None:
            span["turn_index"] = t["order"]
        spans.append(span)
    return {
        "row_index": row_index,
        "input_ids": input_ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "versions": versions,
        "turns": spans,
    }


def session(sid: str, reward: float | None, rows: list[dict], group: str | None = "g"):
    return {
        "session_id": sid,
        "task_id": "t",
        "group_id": group,
        "metadata": {},
        "reward": reward,
        "rows": rows,
    }


def rules(**changes) -> Rules:
    algorithm = {"temperature": 1.0, "off_temperature": "mask", "advantage": "grpo"}
    algorithm.update(
        {k: changes.pop(k) for k in list(changes) if k in AlgorithmConfig.__dataclass_fields__}
    )
    options = {"policy_version": 5, "max_staleness": 1, **changes}
    return Rules(algorithm=AlgorithmConfig(**algorithm), **options)


def batch(sessions, baseline=None, **changes):
    return build_batch(sessions, rules(**changes), baseline)


# --- advantages on spans --------------------------------------------------------------------


def test_grpo_advantage_lands_on_the_turn_tokens_only():
    sessions = [
        session("a", 1.0, [row(3, [turn([5, 5])])]),
        session("b", 0.0, [row(3, [turn([5, 5, 5])])]),
    ]
    out = batch(sessions)
    a, b = out.samples
    # pooled over the 5 turn... returns: one per turn, [1] and [0]: mean 0.5, std 0.5
    assert a.advantages == pytest.approx([0, 0, 0, 1, 1], abs=1e-5)
    assert b.advantages == pytest.approx([0, 0, 0, -1, -1, -1], abs=1e-5)
    assert out.rewards == [1.0, 0.0]
    assert out.staleness == [0] * 5
    assert out.dropped == {}


def test_per_turn_rewards_are_discounted_and_compared_position_by_position():
    multi = row(2, [turn([5], 0.5), turn([5, 5], None, glue=2)])  # turn reward 0.5, session 1
    sessions = [session("m", 1.0, [multi]), session("s", 0.0, [row(2, [turn([5])])])]
    out = batch(sessions, advantage="dr_grpo", discount=0.5)
    m = out.samples[0]
    # returns: m: G0 = 0.5 + 0.5 * 1.0 = 1.0, G1 = 1.0; s: 0.0, its outcome 0.0 at position 1
    spans = multi["turns"]
    assert m.advantages[spans[0]["start"]] == pytest.approx(0.5)
    assert m.advantages[spans[1]["start"] : spans[1]["end"]] == pytest.approx([0.5, 0.5])
    assert m.advantages[spans[0]["end"] : spans[1]["start"]] == [0.0, 0.0]  # glue: no loss
    assert out.samples[1].advantages[2] == pytest.approx(-0.5)


def test_turns_of_a_session_split_over_rows_keep_their_order():
    rows = [row(2, [turn([5], 1.0, order=0)], 0), row(4, [turn([5, 5], order=1)], 1)]
    out = batch(
        [session("x", 0.0, rows, group=None)], advantage="running", baseline=RunningBaseline(0.5)
    )
    first, second = out.samples
    # G0 = 1, G1 = 0; a running baseline with no history: the key's mean outcome, 0
    assert first.advantages[2] == pytest.approx(1.0)
    assert second.advantages[4:] == pytest.approx([0.0, 0.0])


def test_rewards_are_undiscounted_outcomes_and_returns_the_discounted_g0():
    # a 3-turn success at discount 0.9: its outcome is 1, its G_0 0.81
    three = row(1, [turn([5]), turn([5], glue=1), turn([5], glue=1)])
    per_turn = row(1, [turn([5], 0.5), turn([5], 0.25, glue=1)])  # 0.5 + 0.25 + session 1
    sessions = [
        session("three", 1.0, [three]),
        session("per_turn", 1.0, [per_turn]),
        session("empty", 1.0, []),  # no turns: neither a reward nor a return
    ]
    out = batch(sessions, discount=0.9)
    assert out.rewards == pytest.approx([1.0, 1.75], abs=1e-15)
    assert out.returns == pytest.approx([0.81, 0.5 + 0.9 * 1.25], abs=1e-15)


def test_equal_outcomes_of_different_lengths_get_small_advantages_under_a_discount():
    # four successes of 1-4 turns at discount 0.99: the shorter ones are a little better, not
    # a z-score apart (before: -1.73..+1.39 at any discount below 1)
    sessions = [
        session(f"s{n}", 1.0, [row(1, [turn([5], glue=1) for _ in range(n)])]) for n in (1, 2, 3, 4)
    ]
    out = batch(sessions, discount=0.99)
    firsts = [s.advantages[2] for s in out.samples]  # each session's first turn
    g0 = [0.99**k for k in range(4)]
    mean = math.fsum(g0) / 4
    assert firsts == pytest.approx([g - mean for g in g0], rel=1e-12)
    assert max(abs(a) for s in out.samples for a in s.advantages) <= 1 - 0.99**4


# --- dynamic sampling -----------------------------------------------------------------------


def test_dynamic_sampling_drops_a_group_without_contrast_saying_why():
    sessions = [
        session("a1", 1.0, [row(1, [turn([5, 5])])], group="a"),
        session("a2", 1.0, [row(1, [turn([5])])], group="a"),
        session("b1", 1.0, [row(1, [turn([5])])], group="b"),
        session("b2", 0.0, [row(1, [turn([5, 5, 5])])], group="b"),
    ]
    out = batch(sessions, dynamic_sampling=True, max_staleness=0, stale="keep")
    assert [s.session_id for s in out.samples] == ["b1", "b2"]
    assert set(out.dropped) == {"a1", "a2"}
    for reason in out.dropped.values():
        assert reason.startswith("no_contrast: its returns equal its group's mean")
        assert "algorithm.dynamic_sampling" in reason
    assert out.dropped_tokens == 3 and out.loss_tokens == 4
    assert len(out.staleness) == 4  # the dropped sessions' tokens are not trained tokens
    assert out.sampled_tokens == 7
    kept = batch(sessions, dynamic_sampling=False)
    assert kept.dropped == {} and kept.loss_tokens == 7 and kept.dropped_tokens == 0


def test_dynamic_sampling_keeps_a_member_at_the_mean_of_a_group_with_contrast():
    """Rewards 0, 0.5 and 1: the middle one's advantages are exactly 0, but its group has
    contrast, and DAPO leaves out only groups without."""
    sessions = [
        session("low", 0.0, [row(1, [turn([5])])]),
        session("mid", 0.5, [row(1, [turn([5])])]),
        session("high", 1.0, [row(1, [turn([5])])]),
    ]
    out = batch(sessions, dynamic_sampling=True)
    assert out.dropped == {}
    assert [s.session_id for s in out.samples] == ["low", "mid", "high"]
    mid = out.samples[1]
    assert [a for a, m in zip(mid.advantages, mid.loss_mask, strict=True) if m] == [0.0]


def test_dynamic_sampling_drops_the_survivor_of_a_group_whose_partner_was_dropped():
    sessions = [
        session("alone", 1.0, [row(1, [turn([5, 5])])], group="a"),
        session("empty", 0.0, [], group="a"),  # dropped: no turns
        session("b1", 1.0, [row(1, [turn([5])])], group="b"),
        session("b2", 0.0, [row(1, [turn([5])])], group="b"),
    ]
    out = batch(sessions, dynamic_sampling=True)
    assert out.dropped["alone"].startswith("no_contrast: no other session of its group trained")
    assert out.dropped["empty"].startswith("no_turns:")
    assert [s.session_id for s in out.samples] == ["b1", "b2"]


def test_dynamic_sampling_names_the_batch_under_reinforce_pp():
    sessions = [session(f"s{i}", 1.0, [row(1, [turn([5])])], group=f"g{i}") for i in range(3)]
    out = batch(sessions, dynamic_sampling=True, advantage="reinforce_pp")
    assert out.samples == [] and len(out.dropped) == 3
    assert all("its batch's mean" in reason for reason in out.dropped.values())


def test_dynamic_sampling_keeps_what_the_running_baseline_scored():
    # a session without group or task key is baselined by the running baseline: a 0 there is
    # a coincidence (its outcome equals the running mean), not a group without contrast
    keyless = session("keyless", 1.0, [row(1, [turn([5])])], group=None)
    keyless["task_id"] = None
    baseline = RunningBaseline(0.5)
    baseline.update("", 1.0)
    out = batch([keyless], baseline=baseline, dynamic_sampling=True)
    assert out.dropped == {} and out.samples[0].advantages == [0.0, 0.0]
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling"):
        AlgorithmConfig(advantage="running", dynamic_sampling=True)


# --- accounting -----------------------------------------------------------------------------


def test_tokens_of_sessions_dropped_before_masking_are_counted_once_as_in_kept_ones():
    rows = [
        row(1, [turn([0, 0], order=0, alternative=True)], 0),  # no reward: could never train
        row(1, [turn([2, 2, 2], order=1)], 1),
    ]
    sessions = [
        session("stale", 1.0, rows),
        session("long", 1.0, [row(20, [turn([9] * 4)])]),
        session("b", 0.0, [row(1, [turn([9])])]),
        session("c", 1.0, [row(1, [turn([9, 9])])]),
    ]
    out = batch(sessions, policy_version=9, stale="drop", max_staleness=1, row_limit=16)
    assert out.dropped["stale"].startswith("stale:") and out.dropped["long"].startswith("row_")
    assert out.dropped_tokens == 3 + 4  # not the alternative's 2: masked, as in a kept session
    assert out.loss_tokens == 3 and out.masked == {ALTERNATIVE: 2}
    assert out.sampled_tokens == 12
    assert out.tallies["stale"].masked == {ALTERNATIVE: 2}
    assert out.tallies["stale"].dropped_tokens == 3
    assert out.tallies["long"].sampled_tokens == 4 and set(out.tallies) == {"stale", "long"}
    kept = batch(sessions[:1], policy_version=1)  # the same session, kept: the same count
    assert kept.masked == {ALTERNATIVE: 2} and kept.loss_tokens == 3 and kept.sampled_tokens == 5


# --- sampling temperature -------------------------------------------------------------------


def test_turns_at_another_temperature_are_masked_and_counted():
    mixed = row(1, [turn([5, 5], temperature=0.7), turn([5, 5, 5], glue=1, temperature=1.0)])
    sessions = [session("a", 1.0, [mixed]), session("b", 0.0, [row(1, [turn([5])])])]
    out = batch(sessions)
    a = out.samples[0]
    assert a.loss_mask == [0, 0, 0, 0, 1, 1, 1]
    assert out.masked[OFF_TEMPERATURE] == 2 and out.off_policy_tokens == 0
    assert a.fresh == [0, 0, 0, 0, 1, 1, 1]  # the 0.7 tokens never count in the mismatch


def test_a_session_sampled_only_at_another_temperature_is_dropped_saying_why():
    sessions = [
        session("cold", 1.0, [row(1, [turn([5, 5], temperature=0.7)])]),
        session("b", 0.0, [row(1, [turn([5])])]),
        session("c", 1.0, [row(1, [turn([5])])]),
    ]
    out = batch(sessions)
    assert list(out.dropped) == ["cold"]
    reason = out.dropped["cold"]
    assert reason.startswith("no_trainable_tokens:")
    assert "2 sampled at another temperature than the run's 1" in reason
    assert "off_temperature=mask" in reason
    # it is nobody's baseline: b and c form the group on their own
    assert [s.session_id for s in out.samples] == ["b", "c"]
    assert out.samples[0].advantages[1] == pytest.approx(-1.0, abs=1e-5)


def test_off_policy_keeps_the_drawn_distribution_s_logprob():
    warm = row(1, [turn([5, 5], temperature=0.7)], logprob=-1.25)
    sessions = [session("warm", 1.0, [warm]), session("b", 0.0, [row(1, [turn([5])])])]
    out = batch(sessions, off_temperature="off_policy")
    w, b = out.samples
    assert w.loss_mask == [0, 1, 1] and w.behaviour == [0.0, -1.25, -1.25]
    assert out.off_policy_tokens == 2 and out.masked[OFF_TEMPERATURE] == 0
    assert w.fresh == [0, 0, 0] and b.fresh == [0, 1]


@pytest.mark.parametrize("off_temperature", ["mask", "off_policy"])
def test_greedy_turns_are_masked_under_either_setting(off_temperature):
    # argmax is a point mass: no behaviour logprob makes pi_prox / pi_behav mean anything
    mixed = row(1, [turn([5, 5, 5], temperature=0.0), turn([5, 5], glue=1)], logprob=-0.3)
    greedy = row(1, [turn([5, 5], temperature=1e-7)], logprob=-0.3)
    sessions = [
        session("mixed", 1.0, [mixed]),
        session("greedy", 0.0, [greedy]),
        session("b", 0.0, [row(1, [turn([5])])]),
    ]
    out = batch(sessions, off_temperature=off_temperature)
    assert out.masked[GREEDY] == 5 and out.masked[OFF_TEMPERATURE] == 0
    assert out.off_policy_tokens == 0
    m = out.samples[0]
    assert m.session_id == "mixed" and m.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert m.behaviour[5:] == [-0.3, -0.3]  # the tokens that train keep their logprob
    reason = out.dropped["greedy"]
    assert reason.startswith("no_trainable_tokens: every sampled token was masked: ")
    assert "2 decoded greedily" in reason


def test_an_unknown_temperature_is_never_trained_as_if_known():
    unknown = row(1, [turn([5, 5], temperature=None)])
    out = batch(
        [session("u", 1.0, [unknown]), session("b", 0.0, [row(1, [turn([5])])])],
        off_temperature="off_policy",
    )
    assert list(out.dropped) == ["u"]
    assert out.masked[OFF_TEMPERATURE] == 2


def test_the_training_temperature_is_the_one_compared():
    at_07 = row(1, [turn([5, 5], temperature=0.7)])
    out = batch(
        [session("a", 1.0, [at_07]), session("b", 0.0, [row(1, [turn([5], temperature=0.7)])])],
        temperature=0.7,
    )
    assert out.dropped == {} and out.masked[OFF_TEMPERATURE] == 0
    assert out.samples[0].fresh == [0, 1, 1]


# --- alternatives ---------------------------------------------------------------------------


def test_an_alternative_without_its_own_reward_is_masked_and_gets_no_session_reward():
    rows = [
        row(2, [turn([5, 5], order=0, alternative=True)], 0),  # choice 0 of n=2, not continued
        row(2, [turn([5], order=1), turn([5, 5], glue=1, order=2)], 1),  # choice 1, continued
    ]
    sessions = [session("n2", 1.0, rows), session("b", 0.0, [row(2, [turn([5])])])]
    out = batch(sessions, advantage="dr_grpo")
    assert out.masked[ALTERNATIVE] == 2
    samples = [s for s in out.samples if s.session_id == "n2"]
    assert len(samples) == 1  # the alternative's row has nothing left to train
    # path returns 1, 1 against b's 0 at position 0 and its outcome 0 at 1: +0.5 each
    assert samples[0].advantages[2] == pytest.approx(0.5)


def test_an_alternative_with_its_own_reward_trains_on_that_reward_alone():
    rows = [
        row(2, [turn([5], 0.25, order=0, alternative=True)], 0),
        row(2, [turn([5], order=1)], 1),
    ]
    sessions = [session("n2", 1.0, rows), session("b", 0.0, [row(2, [turn([5])])])]
    out = batch(sessions, advantage="dr_grpo")
    # returns at position 0: the alternative 0.25 (not the session's 1), the path turn 1.0, b 0.0
    mean = (0.25 + 1.0 + 0.0) / 3
    alternative, path = (s for s in out.samples if s.session_id == "n2")
    assert alternative.advantages[2] == pytest.approx(0.25 - mean)
    assert path.advantages[2] == pytest.approx(1.0 - mean)
    assert out.masked[ALTERNATIVE] == 0


# --- staleness ------------------------------------------------------------------------------


def test_stale_tokens_are_masked_and_counted():
    sessions = [
        session("a", 1.0, [row(1, [turn([2, 3, 4, 5])])]),
        session("b", 0.0, [row(1, [turn([5])])]),
    ]
    # versions below 3 are stale
    out = batch(sessions, policy_version=5, max_staleness=2, stale="mask")
    a = out.samples[0]
    assert a.loss_mask == [0, 0, 1, 1, 1]
    assert out.stale_tokens == 1 and out.masked[STALE] == 1
    assert sorted(out.staleness) == [0, 0, 1, 2]
    assert a.fresh == [0, 0, 0, 0, 1]  # sampled by the step's own starting weights
    assert out.samples[1].fresh == [0, 1]


def test_keep_trains_stale_tokens_and_records_how_stale_they_are():
    # a long session: its early turn is 4 updates behind, more than max_staleness
    long = row(1, [turn([1, 1], 0.5), turn([4], glue=1), turn([5, 5], glue=1)])
    sessions = [session("long", 1.0, [long]), session("b", 0.0, [row(1, [turn([5])])])]
    assert AlgorithmConfig().stale == "keep"  # the default
    out = batch(sessions, policy_version=5, max_staleness=1)
    assert out.dropped == {} and out.masked == {} and out.stale_tokens == 0
    first = out.samples[0]
    assert first.loss_mask == [0, 1, 1, 0, 1, 0, 1, 1]  # the early turn trains
    assert sorted(out.staleness) == [0, 0, 0, 1, 4, 4]  # one per trained token
    assert first.fresh == [0, 0, 0, 0, 0, 0, 1, 1]
    masked = batch(sessions, policy_version=5, max_staleness=1, stale="mask")
    assert masked.stale_tokens == 2 and masked.samples[0].loss_mask[1:3] == [0, 0]


def test_stale_sessions_are_dropped_in_drop_mode_with_a_reason():
    sessions = [
        session("a", 1.0, [row(1, [turn([2, 5])])]),
        session("b", 0.0, [row(1, [turn([5])])]),
    ]
    out = batch(sessions, policy_version=5, max_staleness=1, stale="drop")
    assert [s.session_id for s in out.samples] == ["b"]
    assert out.dropped_sessions == 1 and out.sessions == 2
    assert out.dropped["a"].startswith("stale: tokens sampled 3 updates before")


def test_a_restart_s_republish_does_not_make_the_sessions_it_gave_back_stale():
    # checkpoint at version 2; the engines went on to 5; the restart republished 2 as 6.
    # Version 6 holds 2's weights (2 updates); 3-5 keep the updates they had (3, 4, 5).
    republished = [(2, 6)]
    assert [versions_behind(v, 6, republished) for v in (1, 2, 3, 4, 5, 6)] == [1, 0, 0, 0, 0, 0]
    assert [versions_behind(v, 8, republished) for v in (1, 2, 3, 4, 5, 6)] == [3, 2, 1, 0, 0, 2]
    sessions = [
        session("a", 1.0, [row(1, [turn([3, 4, 5])])]),
        session("b", 0.0, [row(1, [turn([1, 2])])]),
    ]
    out = batch(sessions, policy_version=6, max_staleness=1, republished=republished, stale="mask")
    assert out.stale_tokens == 0 and out.dropped == {}
    assert sorted(out.staleness) == [0, 0, 0, 0, 1]
    # without the lineage, the version numbers alone would mask a's and b's tokens
    plain = batch(sessions, policy_version=6, max_staleness=1, stale="mask")
    assert plain.stale_tokens == 4


def test_two_restarts_from_the_same_checkpoint():
    # 2 republished as 6, trained to 8 (3 and 4 updates), crashed before a checkpoint: 2 as 9
    republished = [(2, 6), (2, 9)]
    assert [position(v, republished) for v in (2, 5, 6, 7, 8, 9, 10)] == [2, 5, 2, 3, 4, 2, 3]
    assert versions_behind(7, 11, republished) == 1
    assert versions_behind(8, 9, republished) == 0


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_positions_count_updates_along_any_history_of_restarts(data):
    """Simulate a history: steps add an update and a version; a restart goes back to a
    checkpointed version and republishes it under a new number. The rule must give every
    version the number of updates of the weights it published."""
    updates = {0: 0}  # version -> updates of its weights
    checkpoints = [0]
    republished: list[tuple[int, int]] = []
    version = 0
    for _ in range(data.draw(st.integers(1, 30))):
        action = data.draw(st.sampled_from(["step", "step", "checkpoint", "restart"]))
        if action == "step":
            updates[version + 1] = updates[version] + 1
            version += 1
        elif action == "checkpoint":
            checkpoints.append(version)
        else:
            restored = data.draw(st.sampled_from(checkpoints))
            republished.append((restored, version + 1))
            updates[version + 1] = updates[restored]
            version += 1
    for v, count in updates.items():
        assert position(v, republished) == count


# --- bad data never raises ------------------------------------------------------------------


def test_a_session_without_turns_is_dropped_not_raised():
    sessions = [session("empty", 1.0, []), session("b", 0.0, [row(1, [turn([5])])])]
    out = batch(sessions)
    assert out.dropped == {"empty": "no_turns: the session has no model call to train on"}
    assert [s.session_id for s in out.samples] == ["b"]


def test_a_row_longer_than_the_limit_is_dropped_naming_the_limit():
    long_row = row(10, [turn([5] * 10)])
    out = batch(
        [session("long", 1.0, [long_row]), session("b", 0.0, [row(1, [turn([5])])])],
        row_limit=16,
        row_limit_name="the model's context (max_position_embeddings in its config.json)",
    )
    assert out.dropped["long"] == (
        "row_too_long: a row of 20 tokens, more than the model's context "
        "(max_position_embeddings in its config.json) (16)"
    )


def test_a_return_that_is_not_a_number_is_dropped_not_raised():
    sessions = [
        session("huge", 1e308, [row(1, [turn([5], reward=1e308)])]),  # adds up to inf
        session("b", 0.0, [row(1, [turn([5])])]),
        session("c", 1.0, [row(1, [turn([5])])]),
    ]
    out = batch(sessions)
    assert out.dropped["huge"].startswith("bad_reward:")
    assert [s.session_id for s in out.samples] == ["b", "c"]


def test_only_tokens_that_could_train_decide_a_drop():
    # a stale, over-long alternative without a reward of its own is masked, not a reason
    alternative = row(30, [turn([0, 0], order=0, alternative=True)], 0)
    path = row(2, [turn([5, 5], order=1)], 1)
    sessions = [session("a", 1.0, [alternative, path]), session("b", 0.0, [row(2, [turn([5])])])]
    out = batch(sessions, stale="drop", max_staleness=1, row_limit=16)
    assert out.dropped == {}
    assert out.masked[ALTERNATIVE] == 2


def test_a_turn_that_sampled_nothing_is_dropped_saying_so():
    out = batch([session("zero", 1.0, [row(3, [turn([])])])])
    assert out.dropped["zero"] == "no_trainable_tokens: its 1 turn(s) sampled no token"
    assert out.samples == []


@st.composite
def claimed_sessions(draw):
    sessions = []
    for s in range(draw(st.integers(0, 6))):
        rows = []
        order = 0
        for r in range(draw(st.integers(0, 3))):
            turns = []
            for _ in range(draw(st.integers(1, 3))):
                turns.append(
                    turn(
                        draw(st.lists(st.integers(0, 9), max_size=6)),
                        reward=draw(st.none() | st.floats(-1, 1)),
                        glue=draw(st.integers(0, 2)),
                        temperature=draw(st.sampled_from([None, 0.0, 0.7, 1.0, 1.0])),
                        alternative=draw(st.booleans()),
                        order=order,
                    )
                )
                order += 1
            rows.append(row(draw(st.integers(1, 3)), turns, r))
        group = draw(st.sampled_from([None, "g1", "g2"]))
        sessions.append(session(f"s{s}", draw(st.none() | st.floats(-1, 1)), rows, group))
    return sessions


@settings(max_examples=300, deadline=None)
@given(
    sessions=claimed_sessions(),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp", "running"]),
    off_temperature=st.sampled_from(["mask", "off_policy"]),
    stale=st.sampled_from(["keep", "mask", "drop"]),
    max_staleness=st.integers(0, 4),
    max_tokens_per_row=st.none() | st.integers(4, 30),
    dynamic_sampling=st.booleans(),
)
def test_any_claimed_data_becomes_samples_or_reasons(
    sessions, estimator, off_temperature, stale, max_staleness, max_tokens_per_row, dynamic_sampling
):
    out = batch(
        sessions,
        baseline=RunningBaseline(0.5),
        advantage=estimator,
        off_temperature=off_temperature,
        stale=stale,
        policy_version=9,
        max_staleness=max_staleness,
        row_limit=max_tokens_per_row,
        dynamic_sampling=dynamic_sampling and estimator != "running",
    )
    trained = {s.session_id for s in out.samples}
    for s in sessions:  # every session is trained or dropped with a reason, never both
        assert (s["session_id"] in trained) != (s["session_id"] in out.dropped)
    assert all(reason.split(":")[0] in DROP_CODES for reason in out.dropped.values())
    for sample in out.samples:
        assert sample.loss_tokens > 0
        for i, in_loss in enumerate(sample.loss_mask):
            if in_loss:
                assert stale == "keep" or 9 - sample.versions[i] <= max_staleness
                assert math.isfinite(sample.advantages[i])
            assert not (sample.fresh[i] and not in_loss)
        if max_tokens_per_row is not None:
            assert len(sample.input_ids) <= max_tokens_per_row
    assert len(out.staleness) == out.loss_tokens
    assert sorted(out.staleness) == sorted(
        9 - v for s in out.samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m
    )
    assert out.sampled_tokens == sampled(sessions)
    assert set(out.tallies) == set(out.dropped)
    for session_id, tally in out.tallies.items():  # a dropped session's tokens, all of them
        assert tally.sampled_tokens == sampled(
            [s for s in sessions if s["session_id"] == session_id]
        )
    assert sum(t.dropped_tokens for t in out.tallies.values()) == out.dropped_tokens
    assert stale == "mask" or out.stale_tokens == 0


def sampled(sessions) -> int:
    """The loss tokens of the claimed data, every turn's: an alternative without a reward of its
    own is counted (masked) whether its session is kept or dropped, at whichever point."""
    return sum(
        sum(r["loss_mask"][t["start"] : t["end"]])
        for s in sessions
        for r in s["rows"]
        for t in r["turns"]
    )


# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoints_and_the_claim_journal(tmp_path):
    store = Checkpoints(tmp_path, keep=2)
    assert store.latest() is None
    store.journal_claim("c1", 0, 4)
    store.journal_claim("c2", 1, 8)
    assert store.journalled() == ["c1", "c2"]
    for step in (1, 2, 3):
        path = store.path(step)
        path.mkdir(parents=True)
        covered = [{"claim_id": f"c{step}", "sessions": 4, "dropped": {"s": "stale: ..."}}]
        store.commit(
            path,
            TrainerState(run_id="run_a", step=step, version=step + 1, covered_claims=covered),
        )
    store.path(4).mkdir()  # a checkpoint that crashed half-way is not "latest"
    path, state = store.latest()
    assert state.step == 3 and state.version == 4 and state.run_id == "run_a"
    assert state.covered_claims == [
        {"claim_id": "c3", "sessions": 4, "dropped": {"s": "stale: ..."}}
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000003",
        "step-000004",
    ]
    store.clear_journal()
    assert store.journalled() == []


def test_a_checkpoint_of_another_run_is_refused_naming_both(tmp_path):
    state = TrainerState(run_id="run_old", server="http://127.0.0.1:8001", step=2)
    state.check_owner("run_old", "http://127.0.0.1:9999", tmp_path)  # its own: fine, any URL
    with pytest.raises(WrongCheckpoint) as caught:
        state.check_owner("run_new", "http://127.0.0.1:8002", tmp_path)
    message = str(caught.value)
    assert "run run_old (server http://127.0.0.1:8001)" in message
    assert "run run_new on http://127.0.0.1:8002" in message
    assert "run_id=run_old" in message
    anonymous = TrainerState.from_json({"step": 2, "version": 2, "covered_claims": ["c1"]})
    assert anonymous.covered_claims == [{"claim_id": "c1", "sessions": None}]
    with pytest.raises(WrongCheckpoint, match="does not name"):
        anonymous.check_owner("run_new", "http://x", tmp_path)


def test_a_republish_stays_journalled_until_a_checkpoint_holds_it(tmp_path):
    store = Checkpoints(tmp_path, keep=2)
    store.journal_claim("c1", 2, 4)
    store.journal_republish(2, 4)  # written before the engines get the restored weights
    assert store.journalled() == ["c1"] and store.journalled_republishes() == [[2, 4]]
    # settling the claims at start keeps the republishes no checkpoint holds yet
    store.clear_journal(republished=[[2, 4]])
    assert store.journalled() == [] and store.journalled_republishes() == [[2, 4]]
    store.journal_claim("c2", 3, 4)
    assert store.journalled() == ["c2"] and store.journalled_republishes() == [[2, 4]]
    # a checkpoint holds them all: the journal empties
    store.clear_journal()
    assert store.journalled() == [] and store.journalled_republishes() == []


# --- rewards per token for the critic ------------------------------------------------------


def test_under_the_critic_each_turn_s_reward_sits_on_its_last_loss_token():
    """A path of two turns in one row (own rewards 0.5 and none, session reward 1, scaled by 2)
    and an alternative with its own reward 0.25: the first turn's 2 * 0.5 on its last token,
    the session's 2 * 1 on the last turn's last loss token (its stale last token masked), the
    alternative's 2 * 0.25 on its own; 0 elsewhere, and every reward 0 without the critic."""
    path = row(2, [turn([5, 5], 0.5, order=1), turn([5, 5, 3], glue=1, order=2)], 1)
    rows = [row(2, [turn([5], 0.25, order=0, alternative=True)], 0), path]
    sessions = [session("x", 1.0, rows), session("b", 0.0, [row(2, [turn([5])])])]
    changes = dict(advantage="dr_grpo", reward_scale=2.0, stale="mask", max_staleness=1)
    out = batch(sessions, critic=True, **changes)
    alternative, trained_path = (s for s in out.samples if s.session_id == "x")
    assert alternative.rewards == [0.0, 0.0, 0.5]
    want = [0.0] * len(path["input_ids"])
    want[3] = 1.0  # the first turn's tokens are 2..3
    want[6] = 2.0  # the second's are 5..7, token 7 stale (version 3 < 5 - 1) and masked
    assert trained_path.loss_mask[7] == 0
    assert trained_path.rewards == want
    assert out.samples[-1].rewards == [0.0, 0.0, 0.0]  # b: session reward 0
    plain = batch(sessions, **changes)
    assert all(not any(s.rewards) for s in plain.samples)


def test_under_the_critic_a_cut_last_turn_s_reward_reaches_the_turn_before():
    """The session reward 1 sits on the last path turn, which DAPO's overlong filter masks (its
    answer cut at the length limit): the first turn, the row's last one that trains, carries
    the whole return 1 on its last token, as its advantage carries it without the critic
    (before: every reward of the row 0)."""
    path = row(2, [turn([5, 5], order=1), turn([5, 5, 5], glue=1, order=2)], 0)
    path["turns"][1]["finish_reason"] = "length"
    sessions = [session("x", 1.0, [path]), session("b", 0.0, [row(2, [turn([5])])])]
    changes = dict(advantage="dr_grpo", overlong_filter=True)
    trained = next(s for s in batch(sessions, critic=True, **changes).samples)
    assert trained.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0]
    assert trained.rewards == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    plain = next(s for s in batch(sessions, **changes).samples)
    assert plain.advantages[3] == 0.5  # 1 against b's 0: the return reaches it there too


def test_under_the_critic_a_path_split_over_two_rows_rewards_both():
    """A session's two path turns in two rows (its history rewritten between them), session
    reward 1: GAE ends each row's episode at its last loss token, so each row's last trained
    turn carries its return, 1 in both (before: the first row got 0, 1 - 1)."""
    first = row(2, [turn([5, 5], order=1)], 0)
    second = row(3, [turn([5, 5], order=2)], 1)
    sessions = [session("x", 1.0, [first, second]), session("b", 0.0, [row(2, [turn([5])])])]
    one, two = (s for s in batch(sessions, critic=True, advantage="dr_grpo").samples[:2])
    assert one.rewards == [0.0, 0.0, 0.0, 1.0]
    assert two.rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
