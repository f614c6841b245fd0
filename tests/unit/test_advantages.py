"""Advantages: returns and every estimator against plain float64 references (tolerance 1e-12)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from trainer.advantages import (
    RunningBaseline,
    SessionReturns,
    dr_grpo,
    grpo,
    reinforce_pp,
    rloo,
    session_advantages,
    turn_returns,
)

TOL = 1e-12  # every reference here is float64 arithmetic in a different order


def close(actual: list[float], expected: list[float], tol: float = TOL) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= tol * max(1.0, abs(e)) for a, e in zip(actual, expected, strict=True)
    )


def reference_returns(rewards: list[float | None], session: float | None, discount: float):
    """Closed form: G_t = sum over k >= t of discount^(k - t) r_k."""
    r = [0.0 if x is None else x for x in rewards]
    if r and session is not None:
        r[-1] += session
    return [sum(discount ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))]


def reference_grpo(scores: list[float], eps: float = 1e-6) -> list[float]:
    mean, std = statistics.fmean(scores), statistics.pstdev(scores)
    return [(x - mean) / (std + eps) for x in scores]


def reference_rloo(scores: list[float]) -> list[float]:
    return [x - statistics.fmean(scores[:i] + scores[i + 1 :]) for i, x in enumerate(scores)]


def random_scores(rng: random.Random, n: int) -> list[float]:
    return [rng.uniform(-3, 3) for _ in range(n)]


# --- turn_returns ---------------------------------------------------------------------------


def test_returns_by_hand():
    # rewards [1, 0, 2 + 3]: G_2 = 5, G_1 = 0 + 0.5 * 5, G_0 = 1 + 0.5 * 2.5
    assert turn_returns([1.0, None, 2.0], 3.0, 0.5) == [2.25, 2.5, 5.0]


def test_returns_match_the_closed_form():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        rewards = [None if rng.random() < 0.3 else rng.uniform(-2, 2) for _ in range(n)]
        session = None if rng.random() < 0.3 else rng.uniform(-2, 2)
        discount = rng.choice([0.0, 1.0, rng.random()])
        expected = reference_returns(rewards, session, discount)
        assert close(turn_returns(rewards, session, discount), expected)


def test_session_reward_only_lands_on_the_last_turn():
    assert turn_returns([None, None, None], 1.0, 1.0) == [1.0, 1.0, 1.0]
    assert turn_returns([None, None, None], 1.0, 0.0) == [0.0, 0.0, 1.0]


def test_returns_without_turns_are_empty():
    assert turn_returns([], 5.0, 0.9) == []


@pytest.mark.parametrize("discount", [-0.1, 1.01])
def test_discount_out_of_range_is_refused(discount):
    with pytest.raises(ValueError, match="discount"):
        turn_returns([1.0], None, discount)


# --- estimators on one group ------------------------------------------------------------------


def test_estimators_match_references_on_random_groups():
    rng = random.Random(1)
    for _ in range(200):
        scores = random_scores(rng, rng.randint(2, 16))
        mean = statistics.fmean(scores)
        assert close(grpo(scores), reference_grpo(scores))
        assert close(grpo(scores, eps=0.5), reference_grpo(scores, eps=0.5))
        assert close(dr_grpo(scores), [x - mean for x in scores])
        assert close(rloo(scores), reference_rloo(scores))
        assert close(reinforce_pp(scores), reference_grpo(scores))


def test_rloo_is_a_rescaled_dr_grpo():
    # x_i - mean_{j != i} x_j = n / (n - 1) * (x_i - mean): an independent identity
    scores = random_scores(random.Random(2), 7)
    assert close(rloo(scores), [7 / 6 * a for a in dr_grpo(scores)])


def test_grpo_by_hand():
    # mean 2, population std 1 (values 1 and 3)
    assert close(grpo([1.0, 3.0], eps=0.0), [-1.0, 1.0])
    assert close(rloo([1.0, 3.0]), [-2.0, 2.0])


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, rloo, reinforce_pp])
def test_a_group_of_one_has_no_advantage(estimator):
    assert estimator([4.2]) == [0.0]
    assert estimator([]) == []


def test_a_group_without_contrast_has_no_advantage():
    assert grpo([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert reinforce_pp([1.0, 1.0]) == [0.0, 0.0]


# --- running baseline ---------------------------------------------------------------------


def test_running_baseline_is_an_exponential_moving_average():
    baseline = RunningBaseline(momentum=0.9)
    assert baseline.value("a") is None
    expected = None
    for score in [1.0, 0.0, 0.5, 2.0]:
        baseline.update("a", score)
        expected = score if expected is None else 0.9 * expected + 0.1 * score
        assert abs(baseline.value("a") - expected) <= TOL
    assert baseline.value("b") is None


def test_running_baseline_state_round_trips_through_json():
    baseline = RunningBaseline(momentum=0.5)
    baseline.update("task", 1.0)
    baseline.update("", -2.0)
    restored = RunningBaseline(momentum=0.5)
    restored.load_state_dict(json.loads(json.dumps(baseline.state_dict())))
    assert restored.state_dict() == {"task": 1.0, "": -2.0}
    restored.update("task", 3.0)
    assert restored.value("task") == 2.0


@pytest.mark.parametrize("momentum", [-0.1, 1.0])
def test_momentum_out_of_range_is_refused(momentum):
    with pytest.raises(ValueError, match="momentum"):
        RunningBaseline(momentum)


# --- session_advantages -------------------------------------------------------------------


def session(group, task, returns):
    return SessionReturns(group_key=group, task_key=task, returns=returns)


def test_grpo_groups_by_group_key_and_applies_the_shift_to_every_turn():
    sessions = [
        session("g1", "t", [1.0, 0.5]),
        session("g1", "t", [3.0, 2.0, 1.0]),
        session("g2", "t", [10.0]),
        session("g2", "t", [20.0, 5.0]),
    ]
    out = session_advantages(sessions, "grpo", None)
    g1_mean, g1_std = 2.0, 1.0
    g2_mean, g2_std = 15.0, 5.0
    eps = 1e-6
    assert close(out[0], [(1.0 - g1_mean) / (g1_std + eps), (0.5 - g1_mean) / (g1_std + eps)])
    assert close(out[1], [(g - g1_mean) / (g1_std + eps) for g in [3.0, 2.0, 1.0]])
    assert close(out[2], [(10.0 - g2_mean) / (g2_std + eps)])
    assert close(out[3], [(g - g2_mean) / (g2_std + eps) for g in [20.0, 5.0]])


def test_single_turn_sessions_reduce_to_the_group_estimators():
    rng = random.Random(3)
    scores = random_scores(rng, 6)
    sessions = [session("g", None, [x]) for x in scores]
    for name, estimator in [("grpo", grpo), ("dr_grpo", dr_grpo), ("rloo", rloo)]:
        out = session_advantages(sessions, name, None)
        assert close([a[0] for a in out], estimator(scores))


def test_per_turn_advantages_match_a_reference_on_random_batches():
    rng = random.Random(4)
    for _ in range(50):
        sessions = [
            session(
                rng.choice(["a", "b", None]),
                rng.choice(["x", "y"]),
                random_scores(rng, rng.randint(1, 5)),
            )
            for _ in range(rng.randint(1, 12))
        ]
        for name in ["grpo", "dr_grpo", "rloo"]:
            out = session_advantages(sessions, name, None)
            assert all(
                close(out[i], reference_group_advantages(sessions, i, name))
                for i in range(len(sessions))
            )


def reference_group_advantages(sessions, i, name):
    me = sessions[i]
    key = ("group", me.group_key) if me.group_key is not None else ("task", me.task_key)
    members = [
        s
        for s in sessions
        if (("group", s.group_key) if s.group_key is not None else ("task", s.task_key)) == key
    ]
    scores = [s.returns[0] for s in members]
    if len(scores) == 1 or (name == "grpo" and max(scores) == min(scores)):
        return [0.0] * len(me.returns)
    if name == "grpo":
        return [
            (g - statistics.fmean(scores)) / (statistics.pstdev(scores) + 1e-6) for g in me.returns
        ]
    if name == "dr_grpo":
        return [g - statistics.fmean(scores) for g in me.returns]
    others = [s.returns[0] for s in members if s is not me]
    return [g - statistics.fmean(others) for g in me.returns]


def test_task_key_groups_when_there_is_no_group_key():
    sessions = [session(None, "t", [1.0]), session(None, "t", [3.0]), session(None, "u", [9.0])]
    assert session_advantages(sessions, "dr_grpo", None) == [[-1.0], [1.0], [0.0]]


def test_group_and_task_keys_never_share_a_group():
    sessions = [session("same", None, [1.0]), session(None, "same", [3.0])]
    assert session_advantages(sessions, "dr_grpo", None) == [[0.0], [0.0]]


def test_a_group_of_one_gets_zero_on_every_turn():
    sessions = [session("alone", None, [1.0, 5.0, -2.0])]
    for name in ["grpo", "dr_grpo", "rloo"]:
        assert session_advantages(sessions, name, None) == [[0.0, 0.0, 0.0]]


def test_grpo_group_with_equal_scores_gets_zero_even_where_later_returns_differ():
    sessions = [session("g", None, [1.0, 0.0]), session("g", None, [1.0, 1.0])]
    assert session_advantages(sessions, "grpo", None) == [[0.0, 0.0], [0.0, 0.0]]
    # without std scaling the later turns keep their signal
    assert session_advantages(sessions, "dr_grpo", None) == [[0.0, -1.0], [0.0, 0.0]]


def test_keyless_sessions_get_zero_without_a_baseline():
    sessions = [
        session(None, None, [1.0, 2.0]),
        session("g", None, [1.0]),
        session("g", None, [2.0]),
    ]
    assert session_advantages(sessions, "grpo", None)[0] == [0.0, 0.0]


def test_keyless_sessions_use_the_running_baseline_when_given():
    baseline = RunningBaseline(momentum=0.5)
    baseline.update("", 1.0)
    sessions = [
        session(None, None, [3.0, 2.0]),
        session("g", None, [0.0]),
        session("g", None, [2.0]),
    ]
    out = session_advantages(sessions, "grpo", baseline)
    assert out[0] == [2.0, 1.0]
    assert close(out[1] + out[2], reference_grpo([0.0, 2.0]))
    assert baseline.state_dict() == {"": 2.0}  # only the keyless session fed the baseline


def test_reinforce_pp_normalises_over_the_whole_batch_ignoring_groups():
    rng = random.Random(5)
    sessions = [
        session(rng.choice(["a", "b"]), None, random_scores(rng, rng.randint(1, 4)))
        for _ in range(9)
    ]
    scores = [s.returns[0] for s in sessions]
    mean, std = statistics.fmean(scores), statistics.pstdev(scores)
    out = session_advantages(sessions, "reinforce_pp", None)
    for s, advantages in zip(sessions, out, strict=True):
        assert close(advantages, [(g - mean) / (std + 1e-6) for g in s.returns])


def test_reinforce_pp_batch_of_one_has_no_advantage():
    assert session_advantages([session(None, None, [1.0, 3.0])], "reinforce_pp", None) == [
        [0.0, 0.0]
    ]


def test_running_uses_the_batch_mean_of_a_new_key_then_its_moving_average():
    baseline = RunningBaseline(momentum=0.5)
    first = [session("g1", "t", [1.0, 4.0]), session("g2", "t", [3.0]), session(None, None, [5.0])]
    out = session_advantages(first, "running", baseline)
    # key "t": no value yet -> batch mean 2.0; key "": batch mean 5.0
    assert out == [[-1.0, 2.0], [1.0], [0.0]]
    # updated after the batch, in order: t: 1.0 then 0.5 * 1.0 + 0.5 * 3.0 = 2.0
    assert baseline.state_dict() == {"t": 2.0, "": 5.0}
    second = [session(None, "t", [6.0]), session(None, "t", [0.0])]
    assert session_advantages(second, "running", baseline) == [[4.0], [-2.0]]
    assert baseline.value("t") == 0.5 * (0.5 * 2.0 + 0.5 * 6.0) + 0.5 * 0.0


def test_running_reads_the_baseline_before_updating_it():
    baseline = RunningBaseline(momentum=0.0)  # momentum 0: the value is the last score
    baseline.update("t", 10.0)
    sessions = [session(None, "t", [1.0]), session(None, "t", [2.0])]
    assert session_advantages(sessions, "running", baseline) == [[-9.0], [-8.0]]
    assert baseline.value("t") == 2.0


def test_running_needs_a_baseline():
    with pytest.raises(ValueError, match="RunningBaseline"):
        session_advantages([session(None, "t", [1.0])], "running", None)


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown estimator"):
        session_advantages([session(None, "t", [1.0])], "ppo", None)  # type: ignore[arg-type]


def test_a_session_without_returns_is_refused():
    with pytest.raises(ValueError, match="session 1 has no turns"):
        session_advantages([session("g", None, [1.0]), session("g", None, [])], "grpo", None)


def test_empty_batch_gives_no_advantages():
    assert session_advantages([], "grpo", None) == []
    assert session_advantages([], "reinforce_pp", None) == []
