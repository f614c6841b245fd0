"""Normalised advantages under a discount: the outcomes' z-score plus the discount's part in the
outcomes' own size.

A pure difference in length (sessions that reached the same outcome in more or fewer turns) must
give advantages that shrink with 1 - discount, not unit-size z-scores. Checked against the bound
the module states (|A| <= 1 - discount^L for equal outcomes, L the longest path), the issue's two
examples by hand, and a float64 reference written here from the rule's words. Tolerances: 1e-9
absolute on the bound; 1e-9 relative to max(1, |expected|) against the reference (both are
float64 in another order; the rewards there are quarter steps, so no scale is ill-conditioned);
1e-12 on the hand-computed examples.
"""

from __future__ import annotations

import math
import statistics

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer.advantages import SessionReturns, session_advantages, turn_returns

EPS = 1e-6  # session_advantages' default eps
NORMALISED = ("grpo", "reinforce_pp")


def ended_with(reward: float | None, turns: int, discount: float, turn_rewards=None, group="g"):
    """A session of ``turns`` path turns, its returns at ``discount`` and at 1."""
    per_turn = turn_rewards if turn_rewards is not None else [None] * turns
    return SessionReturns(
        group_key=group,
        task_key=None,
        returns=turn_returns(per_turn, reward, discount),
        undiscounted=turn_returns(per_turn, reward, 1.0),
    )


def close(actual: list[float], expected: list[float], tol: float) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= tol * max(1.0, abs(e)) for a, e in zip(actual, expected, strict=True)
    )


# --- the rule, written out from its words ---------------------------------------------------


def stand_in(values: list[float], position: int, outcome: float) -> float:
    """A session's value at ``position``: its return there, else (its path ended) its outcome."""
    return values[position] if position < len(values) else outcome


def reference(sessions: list[SessionReturns], name: str) -> list[list[float]]:
    """At discount 1 (every G equals its U): (G - mean G) / (std G + eps). Else
    A = (U - mean U) / (std U + eps) + (D - mean D) / max(std U, mean |U|), D = G - U, over the
    pool's values (0 when every U is 0). No contrast (fewer than two sessions, or every G
    equal): 0. One pool: the group (all sessions share a key here) or, for reinforce_pp, the
    batch; path turns only."""
    out = []
    for me in sessions:
        advantages = []
        for t, (g, u) in enumerate(zip(me.returns, me.undiscounted, strict=True)):
            discounted = [stand_in(s.returns, t, s.returns[-1]) for s in sessions]
            undiscounted = [stand_in(s.undiscounted, t, s.undiscounted[-1]) for s in sessions]
            if len(sessions) < 2 or len(set(discounted)) == 1:
                advantages.append(0.0)
                continue
            if discounted == undiscounted:
                scale = statistics.pstdev(discounted) + EPS
                advantages.append((g - statistics.fmean(discounted)) / scale)
                continue
            spread = statistics.pstdev(undiscounted)
            unit = max(spread, statistics.fmean(abs(x) for x in undiscounted))
            if unit == 0:
                advantages.append(0.0)
                continue
            by = [gd - ud for gd, ud in zip(discounted, undiscounted, strict=True)]
            outcome_part = (u - statistics.fmean(undiscounted)) / (spread + EPS)
            advantages.append(outcome_part + ((g - u) - statistics.fmean(by)) / unit)
        out.append(advantages)
    return out


quarters = st.integers(-12, 12).map(lambda k: k / 4)  # exact sums: no ill-conditioned scale


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    discount=st.floats(0, 1, exclude_min=True) | st.sampled_from([0.5, 0.9, 0.99, 1.0]),
)
def test_normalised_advantages_match_a_float64_reference(data, discount):
    sessions = []
    for _ in range(data.draw(st.integers(2, 8))):
        turns = data.draw(st.integers(1, 6))
        per_turn = data.draw(st.lists(st.none() | quarters, min_size=turns, max_size=turns))
        sessions.append(ended_with(data.draw(st.none() | quarters), turns, discount, per_turn))
    want = reference(sessions, "grpo")
    assume(any(a != 0 for advantages in want for a in advantages))  # pools with contrast
    for name in NORMALISED:
        got = session_advantages(sessions, name, None)
        assert all(close(g, w, 1e-9) for g, w in zip(got, want, strict=True)), name


@settings(max_examples=400, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    discount=st.floats(0, 1, exclude_min=True) | st.sampled_from([0.5, 0.9, 0.99, 0.999, 1.0]),
    reward=st.floats(-1e6, 1e6) | st.sampled_from([0.0, 1.0, -1.0]),
)
def test_equal_outcomes_of_any_lengths_stay_within_one_minus_discount_to_the_l(
    lengths, discount, reward
):
    sessions = [ended_with(reward, n, discount) for n in lengths]
    bound = 1 - discount ** max(lengths)
    for name in NORMALISED:
        for advantages in session_advantages(sessions, name, None):
            assert all(abs(a) <= bound + 1e-9 for a in advantages), (name, advantages, bound)


# --- the examples -------------------------------------------------------------------


def test_four_successes_of_one_to_four_turns_shrink_with_one_minus_discount():
    # before: -1.73..+1.39 at each of these discounts
    for discount in (0.9, 0.99, 0.999):
        sessions = [ended_with(1.0, n, discount) for n in (1, 2, 3, 4)]
        for name in NORMALISED:
            out = session_advantages(sessions, name, None)
            # at position 0 the returns are discount^0..discount^3 and every outcome is 1: the
            # scale is 1, so each advantage is its return minus their mean
            firsts = [discount ** (n - 1) for n in (1, 2, 3, 4)]
            mean = math.fsum(firsts) / 4
            assert close([a[0] for a in out], [g - mean for g in firsts], 1e-12)
            largest = max(abs(a) for advantages in out for a in advantages)
            assert largest <= 1 - discount**4
            # about (0 + 1 + 2 + 3) / 4 = 1.5 times 1 - discount, to first order
            assert 1.3 * (1 - discount) <= largest <= 1.5 * (1 - discount), (discount, largest)


def test_four_failures_of_one_to_four_turns_at_0_99_stay_small():
    sessions = [ended_with(-1.0, n, 0.99) for n in (1, 2, 3, 4)]
    for name in NORMALISED:
        out = session_advantages(sessions, name, None)
        assert all(abs(a) <= 0.04 for advantages in out for a in advantages)
        assert any(a != 0 for advantages in out for a in advantages)  # not silenced either
        # the quickest failure is the worst: the least discounted -1
        assert out[0][0] < 0 < out[3][0]


# --- the scale by hand ----------------------------------------------------------------------


def test_an_outcome_contrast_and_the_discount_s_part_are_scaled_apart():
    # two successes (1 and 3 turns) and a failure (1 turn) at discount 0.5. Position 0:
    # undiscounted 1, 1, 0 (mean 2/3, std sqrt(2)/3); the discount took 0, 0.75, 0 off them
    # (D = 0, -0.75, 0, mean -1/4), measured in max(std, mean |U| = 2/3) = 2/3
    sessions = [ended_with(1.0, 1, 0.5), ended_with(1.0, 3, 0.5), ended_with(0.0, 1, 0.5)]
    out = session_advantages(sessions, "grpo", None)
    spread = math.sqrt(2) / 3 + EPS
    want = [
        (1 - 2 / 3) / spread + (0 + 1 / 4) / (2 / 3),
        (1 - 2 / 3) / spread + (-0.75 + 1 / 4) / (2 / 3),
        (0 - 2 / 3) / spread + (0 + 1 / 4) / (2 / 3),
    ]
    assert close([a[0] for a in out], want, 1e-12)
    # the slow success is still far above the failure, a little below the quick success
    assert out[2][0] < out[1][0] < out[0][0]


def test_a_tiny_outcome_spread_never_magnifies_a_spread_of_lengths():
    # before, scaling every return by the outcomes' std: rewards 1, 1, 1 and 0.999 after 1 to 40
    # turns at discount 0.9 gave advantages in the hundreds
    sessions = [ended_with(r, n, 0.9) for r, n in ((1.0, 1), (1.0, 10), (1.0, 40), (0.999, 1))]
    for name in NORMALISED:
        out = session_advantages(sessions, name, None)
        assert max(abs(a) for advantages in out for a in advantages) < 3.0


def test_equal_outcomes_of_zero_give_no_signal():
    # per-turn rewards that cancel: every undiscounted value is 0 at position 0, the
    # discounted ones differ (1 - 0.5 against -1 + 0.5): no outcome to scale by
    sessions = [
        ended_with(None, 2, 0.5, turn_rewards=[1.0, -1.0]),
        ended_with(None, 2, 0.5, turn_rewards=[-1.0, 1.0]),
    ]
    assert [s.undiscounted[0] for s in sessions] == [0.0, 0.0]
    for name in NORMALISED:
        assert [a[0] for a in session_advantages(sessions, name, None)] == [0.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(
    rewards=st.lists(st.floats(-3, 3), min_size=2, max_size=8),
    lengths=st.data(),
)
def test_at_discount_one_the_undiscounted_values_change_nothing(rewards, lengths):
    """The scale at discount 1 is exactly the old std + eps: bit for bit."""
    turns = [lengths.draw(st.integers(1, 5)) for _ in rewards]
    given_both = [ended_with(r, n, 1.0) for r, n in zip(rewards, turns, strict=True)]
    returns_only = [SessionReturns("g", None, s.returns) for s in given_both]
    for name in NORMALISED:
        assert session_advantages(given_both, name, None) == session_advantages(
            returns_only, name, None
        )
