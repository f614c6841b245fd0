"""Advantages: returns and every estimator of the table against plain float64 references.

Tolerance 1e-12 (relative to 1): every reference here is float64 arithmetic in another order
(the `statistics` module, sums by hand). The property tests draw random reward shapes (per-turn
and session rewards, either or both missing), group sizes, turn counts and discounts with
hypothesis and check what must hold for any of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import typing

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer.advantages import (
    ESTIMATORS,
    EstimatorName,
    RunningBaseline,
    SessionReturns,
    session_advantages,
    turn_returns,
)
from trainer.config import ESTIMATOR_HELP, AlgorithmConfig

TOL = 1e-12
EPS = 1e-6  # session_advantages' default: the grpo / reinforce_pp denominator is std + EPS
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
NORMALISED = ("grpo", "reinforce_pp")


def close(actual: list[float], expected: list[float], tol: float = TOL) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= tol * max(1.0, abs(e)) for a, e in zip(actual, expected, strict=True)
    )


def session(group, task, returns):
    return SessionReturns(group_key=group, task_key=task, returns=returns)


# --- the table ------------------------------------------------------------------------------


def test_the_table_is_the_one_list_of_estimators():
    assert set(typing.get_args(EstimatorName)) == set(ESTIMATORS)
    for name, spec in ESTIMATORS.items():  # the config takes every name, and says what it does
        assert AlgorithmConfig(advantage=name).advantage == name
        assert f"{name}: {spec.help}" in ESTIMATOR_HELP


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown estimator"):
        session_advantages([session(None, "t", [1.0])], "ppo", None)


# --- turn_returns ---------------------------------------------------------------------------


def reference_returns(rewards: list[float | None], session_reward: float | None, discount: float):
    """Closed form: G_t = sum over k >= t of discount^(k - t) r_k."""
    r = [0.0 if x is None else x for x in rewards]
    if r and session_reward is not None:
        r[-1] += session_reward
    return [sum(discount ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))]


def test_returns_by_hand():
    # rewards [1, 0, 2 + 3]: G_2 = 5, G_1 = 0 + 0.5 * 5, G_0 = 1 + 0.5 * 2.5
    assert turn_returns([1.0, None, 2.0], 3.0, 0.5) == [2.25, 2.5, 5.0]


@settings(max_examples=300, deadline=None)
@given(
    rewards=st.lists(st.none() | st.floats(-2, 2), max_size=12),
    session_reward=st.none() | st.floats(-2, 2),
    discount=st.sampled_from([0.0, 1.0]) | st.floats(0, 1),
)
def test_returns_match_the_closed_form(rewards, session_reward, discount):
    expected = reference_returns(rewards, session_reward, discount)
    assert close(turn_returns(rewards, session_reward, discount), expected, 1e-11)


def test_session_reward_only_lands_on_the_last_turn():
    assert turn_returns([None, None, None], 1.0, 1.0) == [1.0, 1.0, 1.0]
    assert turn_returns([None, None, None], 1.0, 0.0) == [0.0, 0.0, 1.0]
    assert turn_returns([], 5.0, 0.9) == []


# --- a float64 reference of every estimator ---------------------------------------------------


def pool_key(s: SessionReturns):
    if s.group_key is not None:
        return ("group", s.group_key)
    if s.task_key is not None:
        return ("task", s.task_key)
    return None


def values_at(s: SessionReturns, position: int) -> list[float]:
    """What a session brings to the pool at ``position``: its returns there, else, once its
    path has ended, its outcome."""
    own = [g for g, p in zip(s.returns, s.positions, strict=True) if p == position]
    return own if own or position < s.length else [s.outcome]


def reference(sessions: list[SessionReturns], name: str) -> list[list[float]]:
    """Each estimator written out plainly, position by position (no running baseline:
    keyless sessions get 0)."""
    out = []
    for me in sessions:
        if name == "reinforce_pp":
            members = [s for s in sessions if s.returns]
        elif pool_key(me) is None:
            out.append([0.0] * len(me.returns))
            continue
        else:
            members = [s for s in sessions if s.returns and pool_key(s) == pool_key(me)]
        advantages = []
        for g, position in zip(me.returns, me.positions, strict=True):
            pool = [(s, values_at(s, position)) for s in members]
            pool = [(s, vs) for s, vs in pool if vs]
            values = [v for _, vs in pool for v in vs]
            if len(pool) < 2 or max(values) == min(values):
                advantages.append(0.0)
                continue
            mean = statistics.fmean(values)
            if name in NORMALISED:
                advantages.append((g - mean) / (statistics.pstdev(values) + EPS))
            elif name == "dr_grpo":
                advantages.append(g - mean)
            else:  # rloo: the mean of the other sessions' values at this position
                others = [v for s, vs in pool if s is not me for v in vs]
                advantages.append(g - statistics.fmean(others))
        out.append(advantages)
    return out


def test_one_turn_per_session_is_textbook_grpo_rloo_and_dr_grpo():
    rng = random.Random(1)
    for _ in range(100):
        scores = [rng.uniform(-3, 3) for _ in range(rng.randint(2, 16))]
        sessions = [session("g", None, [x]) for x in scores]
        mean, std = statistics.fmean(scores), statistics.pstdev(scores)
        n = len(scores)
        textbook = {
            "grpo": [(x - mean) / (std + EPS) for x in scores],
            "dr_grpo": [x - mean for x in scores],
            "rloo": [x - (sum(scores) - x) / (n - 1) for x in scores],
            "reinforce_pp": [(x - mean) / (std + EPS) for x in scores],
        }
        for name, want in textbook.items():
            got = [a for (a,) in session_advantages(sessions, name, None)]
            assert close(got, want), name


def test_grpo_by_hand_position_by_position():
    # a: returns 1, 0.5 (positions 0, 1); b: 0 (position 0), then its outcome 0 stands in at 1
    out = session_advantages(
        [session("g", None, [1.0, 0.5]), session("g", None, [0.0])], "grpo", None
    )
    assert close(out[0], [0.5 / (0.5 + EPS), 0.25 / (0.25 + EPS)])
    assert close(out[1], [-0.5 / (0.5 + EPS)])


def test_the_issue_case_per_turn_rewards_with_nearly_equal_first_returns():
    # Before: the group's statistics came from the first turn's returns (here almost equal,
    # std ~1e-9) and were applied to every turn: advantages of 1e4 to 1e5.
    sessions = [
        session("g", None, turn_returns([0.5, None], 0.5, 1.0)),  # [1.0, 0.5]
        session("g", None, turn_returns([0.5 + 1e-9, None], 0.5, 1.0)),
        session("g", None, turn_returns([0.0, 1.0], None, 1.0)),  # [1.0, 1.0]
    ]
    out = session_advantages(sessions, "grpo", None)
    assert max(abs(a) for adv in out for a in adv) <= math.sqrt(3 - 1)
    want = reference(sessions, "grpo")
    assert all(close(g, w) for g, w in zip(out, want, strict=True))


def test_equal_outcomes_under_a_discount_get_zero():
    # four sessions of three turns, each rewarded 1 at the end, discount 0.9: the returns
    # 0.81, 0.9, 1.0 differ only by position, which says nothing about the sessions
    sessions = [session("g", None, turn_returns([None] * 3, 1.0, 0.9)) for _ in range(4)]
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert session_advantages(sessions, name, None) == [[0.0] * 3] * 4, name


def test_a_long_success_and_a_short_failure_are_textbook_grpo_on_every_turn():
    # nine turns rewarded 1, one turn rewarded 0: every turn of each gets its session's +-1
    out = session_advantages(
        [session("g", None, [1.0] * 9), session("g", None, [0.0])], "grpo", None
    )
    assert close(out[0], [1 / (1 + 2 * EPS)] * 9) and close(out[1], [-1 / (1 + 2 * EPS)])


# --- properties over random reward shapes ---------------------------------------------------


@st.composite
def batches(draw, equal_groups: bool = False):
    """Sessions with random keys, turn counts, per-turn and session rewards, a discount, and
    rewarded alternatives. With ``equal_groups`` every session of a group has the same rewards
    (its own number of turns each, and none of the alternatives' kind)."""
    discount = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]) | st.floats(0, 1))
    rewards = st.none() | st.floats(-3, 3) | st.sampled_from([0.0, 1.0])
    sessions = []
    for g in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from([("group", f"g{g}"), ("task", f"t{g}"), None]))
        group = key[1] if key and key[0] == "group" else None
        task = key[1] if key and key[0] == "task" else None
        shared_turns = draw(st.lists(rewards, min_size=1, max_size=5))
        shared_session = draw(rewards)
        for _ in range(draw(st.integers(1, 8))):
            if equal_groups:
                path = turn_returns(shared_turns, shared_session, discount)
                sessions.append(session(group, task, path))
                continue
            turns = draw(st.integers(1, 5))
            per_turn = draw(st.lists(rewards, min_size=turns, max_size=turns))
            path = turn_returns(per_turn, draw(rewards), discount)
            extra = draw(
                st.lists(st.tuples(st.integers(0, turns - 1), st.floats(-3, 3)), max_size=2)
            )
            sessions.append(
                SessionReturns(
                    group,
                    task,
                    path + [v for _, v in extra],
                    positions=list(range(turns)) + [p for p, _ in extra],
                    length=turns,
                    outcome=path[-1],
                )
            )
    return sessions


@settings(max_examples=300, deadline=None)
@given(sessions=batches())
def test_every_estimator_matches_its_float64_reference(sessions):
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        got = session_advantages(sessions, name, None)
        want = reference(sessions, name)
        assert all(close(g, w, 1e-9) for g, w in zip(got, want, strict=True)), name


@settings(max_examples=300, deadline=None)
@given(sessions=batches())
def test_std_normalised_advantages_stay_within_a_z_score(sessions):
    for name in NORMALISED:
        out = session_advantages(sessions, name, None)
        for me, advantages in zip(sessions, out, strict=True):
            members = [s for s in sessions if name == "reinforce_pp" or pool_key(s) == pool_key(me)]
            for a, position in zip(advantages, me.positions, strict=True):
                n = sum(len(values_at(s, position)) for s in members)
                assert abs(a) <= math.sqrt(max(n - 1, 0)) * (1 + 1e-9), (name, a, n)


@settings(max_examples=300, deadline=None)
@given(sessions=batches(equal_groups=True))
def test_a_group_whose_sessions_got_the_same_rewards_gets_zero_from_every_estimator(sessions):
    """Any discount, per-turn rewards or not: equal sessions are equal position by position."""
    for name in GROUP_ESTIMATORS:
        assert all(a == 0.0 for adv in session_advantages(sessions, name, None) for a in adv)
    # reinforce_pp pools the whole batch: zero when every session of the batch is the same
    if len({tuple(s.returns) for s in sessions}) == 1:
        assert all(
            a == 0.0 for adv in session_advantages(sessions, "reinforce_pp", None) for a in adv
        )


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.tuples(st.floats(-3, 3), st.integers(1, 6)), min_size=1, max_size=8),
        min_size=1,
        max_size=3,
    )
)
def test_one_reward_per_session_without_discount_is_textbook_on_every_turn(groups):
    """Session rewards only, discount 1: each turn gets its session's per-session advantage,
    whatever the sessions' lengths."""
    sessions, rewards = [], []
    for g, members in enumerate(groups):
        for reward, turns in members:
            sessions.append(session(f"g{g}", None, turn_returns([None] * turns, reward, 1.0)))
            rewards.append((f"g{g}", reward))
    got = session_advantages(sessions, "dr_grpo", None)
    for (group, reward), advantages in zip(rewards, got, strict=True):
        scores = [r for g, r in rewards if g == group]
        want = 0.0 if len(set(scores)) < 2 else reward - statistics.fmean(scores)
        assert all(abs(a - want) <= 1e-9 for a in advantages)


@settings(max_examples=200, deadline=None)
@given(sessions=batches(), shift=st.floats(-5, 5))
def test_a_constant_added_to_every_return_changes_no_advantage(sessions, shift):
    moved = [
        dataclasses.replace(s, returns=[g + shift for g in s.returns], outcome=s.outcome + shift)
        for s in sessions
    ]
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        before = session_advantages(sessions, name, None)
        after = session_advantages(moved, name, None)
        assert all(close(a, b, 1e-8) for a, b in zip(after, before, strict=True)), name


@settings(max_examples=100, deadline=None)
@given(returns=st.lists(st.floats(-3, 3), min_size=1, max_size=6))
def test_a_group_of_one_session_gets_zero_on_every_turn(returns):
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert session_advantages([session("alone", None, returns)], name, None) == [
            [0.0] * len(returns)
        ]


# --- keys -----------------------------------------------------------------------------------


def test_task_key_groups_when_there_is_no_group_key():
    sessions = [session(None, "t", [1.0]), session(None, "t", [3.0]), session(None, "u", [9.0])]
    assert session_advantages(sessions, "dr_grpo", None) == [[-1.0], [1.0], [0.0]]


def test_group_and_task_keys_never_share_a_group():
    sessions = [session("same", None, [1.0]), session(None, "same", [3.0])]
    assert session_advantages(sessions, "dr_grpo", None) == [[0.0], [0.0]]


def test_a_session_with_nothing_trained_is_nobody_s_partner():
    # its empty returns neither make the other session a group of two nor get advantages
    sessions = [session("g", None, [1.0, 2.0]), SessionReturns("g", None, [])]
    assert session_advantages(sessions, "grpo", None) == [[0.0, 0.0], []]


def test_empty_batch_gives_no_advantages():
    for name in ESTIMATORS:
        assert session_advantages([], name, RunningBaseline(0.5)) == []


# --- the running baseline -------------------------------------------------------------------


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
    assert close(out[1] + out[2], [-1 / (1 + EPS), 1 / (1 + EPS)])
    # only the keyless session fed the baseline, with its outcome (last return) 2.0
    assert baseline.state_dict() == {"": 0.5 * 1.0 + 0.5 * 2.0}


def test_running_uses_the_mean_outcome_of_a_new_key_then_its_moving_average():
    baseline = RunningBaseline(momentum=0.5)
    first = [session("g1", "t", [1.0, 4.0]), session("g2", "t", [2.0]), session(None, None, [5.0])]
    out = session_advantages(first, "running", baseline)
    # key "t": no value yet -> the mean of its sessions' outcomes 4 and 2 = 3; key "": 5
    assert out == [[-2.0, 1.0], [-1.0], [0.0]]
    # updated after the batch with each session's outcome, in order: 4, then 2
    assert baseline.state_dict() == {"t": 0.5 * 4.0 + 0.5 * 2.0, "": 5.0}
    second = [session(None, "t", [6.0]), session(None, "t", [0.0])]
    assert session_advantages(second, "running", baseline) == [[3.0], [-3.0]]


def test_running_reads_the_baseline_before_updating_it():
    baseline = RunningBaseline(momentum=0.0)  # momentum 0: the value is the last score
    baseline.update("t", 10.0)
    sessions = [session(None, "t", [1.0]), session(None, "t", [2.0])]
    assert session_advantages(sessions, "running", baseline) == [[-9.0], [-8.0]]
    assert baseline.value("t") == 2.0


def test_running_needs_a_baseline():
    with pytest.raises(ValueError, match="RunningBaseline"):
        session_advantages([session(None, "t", [1.0])], "running", None)


@settings(max_examples=100, deadline=None)
@given(sessions=batches(equal_groups=True))
def test_running_is_zero_on_equal_returns_until_it_has_a_history(sessions):
    # the documented exception: a first batch is its own baseline, so equal returns give 0
    assume(all(len({g for g in s.returns}) <= 1 for s in sessions))
    keys = {s.task_key for s in sessions}
    values_by_key = {k: {g for s in sessions if s.task_key == k for g in s.returns} for k in keys}
    out = session_advantages(sessions, "running", RunningBaseline(0.9))
    for s, adv in zip(sessions, out, strict=True):
        if len(values_by_key[s.task_key]) == 1:
            assert all(a == 0.0 for a in adv)
