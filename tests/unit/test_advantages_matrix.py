"""The advantage and reward side of the algorithm matrix (issue 28), each against a float64
reference written from its paper's definition, not from trainer/advantages.py:

- LitePPO (Liu et al. 2025, "Part I: Tricks or Traps?", arXiv 2508.08221, the advantage
  normalisation it keeps: group-level mean, batch-level std):
  A_i = (r_i - mean_group(r)) / (std_batch(r) + eps);
- REINFORCE++-baseline (Hu et al., arXiv 2501.03262, "REINFORCE++ w/ baseline": subtract the
  group mean, then normalise globally): A'_i = r_i - mean_group(r),
  A_i = (A'_i - mean_batch(A')) / (std_batch(A') + eps);
- the std's form: population (over N) or sample (Bessel's N - 1, `statistics.stdev`);
- DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), with exact
  rational arithmetic; its overlong filtering (truncated answers out of the loss);
- reward scaling and clipping (clip after scale).

Tolerance 1e-12 relative (1e-12 absolute below 1): the references are float64 arithmetic in
another order (the `statistics` module's exact sums against math.fsum), so they agree to a few
ulps; nothing here is loosened to pass.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.store.rows import TurnTokens, assemble_rows
from trainer.advantages import (
    ESTIMATORS,
    SessionReturns,
    overlong_penalty,
    session_advantages,
    shaped_reward,
    turn_returns,
)
from trainer.config import AlgorithmConfig, ConfigError, load_config
from trainer.figures import masked_tokens
from trainer.rollouts import OVERLONG, Rules, build_batch

TOL = 1e-12
EPS = 1e-6  # session_advantages' default eps
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"


def close(actual: list[float], expected: list[float], tol: float = TOL) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= tol * max(1.0, abs(e)) for a, e in zip(actual, expected, strict=True)
    )


def flat(nested: list[list[float]]) -> list[float]:
    return [x for values in nested for x in values]


def std(values: list[float], form: str) -> float:
    return statistics.pstdev(values) if form == "population" else statistics.stdev(values)


# --- LitePPO and REINFORCE++-baseline: one reward per session -------------------------------


def lite_ppo(groups: list[list[float]], form: str = "population") -> list[list[float]]:
    """LitePPO: each reward less its group's mean, over the std of every reward of the batch.
    A group without spread (or of one session) gives no signal: 0."""
    batch_std = std([r for group in groups for r in group], form)
    return [
        [0.0] * len(group)
        if len(group) < 2 or len(set(group)) == 1
        else [(r - statistics.fmean(group)) / (batch_std + EPS) for r in group]
        for group in groups
    ]


def reinforce_pp_baseline(groups: list[list[float]], form: str = "population") -> list[list[float]]:
    """REINFORCE++-baseline: A' = r - group mean; A = (A' - batch mean A') / (batch std A' + eps).
    A group without spread gives no signal: 0."""
    centred = [[r - statistics.fmean(group) for r in group] for group in groups]
    flat = [a for group in centred for a in group]
    mean, spread = statistics.fmean(flat), std(flat, form)
    return [
        [0.0] * len(group)
        if len(group) < 2 or len(set(group)) == 1
        else [(a - mean) / (spread + EPS) for a in c]
        for group, c in zip(groups, centred, strict=True)
    ]


def by_group(groups: list[list[float]]) -> list[SessionReturns]:
    return [
        SessionReturns(group_key=f"g{g}", task_key=None, returns=[r])
        for g, group in enumerate(groups)
        for r in group
    ]


def regroup(groups: list[list[float]], flat: list[list[float]]) -> list[list[float]]:
    out, k = [], 0
    for group in groups:
        out.append([a for (a,) in flat[k : k + len(group)]])
        k += len(group)
    return out


rewards = st.floats(-10, 10, allow_nan=False) | st.sampled_from([0.0, 1.0])
batches = st.lists(st.lists(rewards, min_size=1, max_size=6), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(groups=batches, form=st.sampled_from(["population", "sample"]))
def test_lite_ppo_and_reinforce_pp_baseline_match_their_papers(groups, form):
    sessions = by_group(groups)
    assume_two = sum(len(g) for g in groups) >= 2  # a sample std needs two values
    if not assume_two and form == "sample":
        return
    for name, reference in (
        ("lite_ppo", lite_ppo),
        ("reinforce_pp_baseline", reinforce_pp_baseline),
    ):
        got = regroup(groups, session_advantages(sessions, name, None, std=form))
        want = reference(groups, form)
        for g, w in zip(got, want, strict=True):
            # the batch mean of A' is 0 up to rounding (each group's centred values sum to 0),
            # which the reference subtracts and the estimator leaves out: a few ulps of the
            # rewards' size apart
            assert close(g, w, 1e-9), (name, got, want)


def test_lite_ppo_and_reinforce_pp_baseline_are_two_formulas():
    # Two groups with different means: the batch std of the rewards holds the spread between
    # the groups' means, the std of the group-centred rewards does not.
    groups = [[0.0, 1.0], [10.0, 11.0]]
    lite = regroup(groups, session_advantages(by_group(groups), "lite_ppo", None))
    baseline = regroup(groups, session_advantages(by_group(groups), "reinforce_pp_baseline", None))
    batch_std = statistics.pstdev([0.0, 1.0, 10.0, 11.0])  # 5.0249...
    assert close(lite[0], [-0.5 / (batch_std + EPS), 0.5 / (batch_std + EPS)])
    assert close(baseline[0], [-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)])
    assert abs(lite[0][0] - baseline[0][0]) > 0.8


@settings(max_examples=200, deadline=None)
@given(group=st.lists(rewards, min_size=2, max_size=8), shift=st.floats(-5, 5))
def test_they_agree_when_every_group_has_the_same_mean(group, shift):
    # one group: LitePPO = REINFORCE++-baseline = GRPO; two groups of the same mean too
    one = by_group([group])
    lite = session_advantages(one, "lite_ppo", None)
    assert close(flat(lite), flat(session_advantages(one, "reinforce_pp_baseline", None)))
    assert close(flat(lite), flat(session_advantages(one, "grpo", None)))
    mirrored = [group, [2 * statistics.fmean(group) - r for r in group]]
    a = session_advantages(by_group(mirrored), "lite_ppo", None)
    b = session_advantages(by_group(mirrored), "reinforce_pp_baseline", None)
    assert close(flat(a), flat(b), 1e-9)


def test_a_lone_session_gets_nothing_but_counts_in_the_batch_std():
    groups = [[0.0, 2.0], [7.0]]
    got = regroup(groups, session_advantages(by_group(groups), "lite_ppo", None))
    assert got[1] == [0.0]
    assert close(got[0], lite_ppo(groups)[0])  # the batch std includes the 7.0


def test_a_group_with_nothing_trained_at_a_position_brings_nothing_to_the_batch():
    # g1's sessions train only their second turn (the first was masked): at position 0 their
    # group's pool is empty (this crashed reinforce_pp_baseline before: the mean of nothing)
    sessions = [
        SessionReturns("g1", None, [1.0], positions=[1], length=2),
        SessionReturns("g1", None, [0.0], positions=[1], length=2),
        SessionReturns("g2", None, [1.0, 0.0]),
        SessionReturns("g2", None, [0.0, 0.0]),
    ]
    baseline = session_advantages(sessions, "reinforce_pp_baseline", None)
    spread_1 = statistics.pstdev([0.5, -0.5, 0.0, 0.0])  # position 1: g1 centred, g2 centred
    assert close(baseline[0], [0.5 / (spread_1 + EPS)])
    assert close(baseline[2], [0.5 / (0.5 + EPS), 0.0])  # position 0: g2 alone
    lite = session_advantages(sessions, "lite_ppo", None)
    assert close(lite[0], [0.5 / (statistics.pstdev([1.0, 0.0, 0.0, 0.0]) + EPS)])
    assert close(lite[3], [-0.5 / (0.5 + EPS), 0.0])


# --- the std's form ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(group=st.lists(rewards, min_size=2, max_size=10))
def test_sample_std_is_bessel_s_and_population_stays_the_default(group):
    sessions = by_group([group])
    mean = statistics.fmean(group)
    if len(set(group)) == 1:
        return
    for name in ("grpo", "reinforce_pp"):
        sample = flat(session_advantages(sessions, name, None, std="sample"))
        assert close(sample, [(r - mean) / (statistics.stdev(group) + EPS) for r in group])
        default = flat(session_advantages(sessions, name, None))
        assert close(default, [(r - mean) / (statistics.pstdev(group) + EPS) for r in group])
        n = len(group)  # the largest z-score n numbers reach under the sample std
        assert max(abs(a) for a in sample) <= (n - 1) / math.sqrt(n) + 1e-9


def test_only_estimators_that_divide_by_a_std_take_the_option():
    for name, spec in ESTIMATORS.items():
        if spec.uses_std:
            assert AlgorithmConfig(advantage=name, advantage_std="sample").advantage_std == "sample"
        else:
            with pytest.raises(ConfigError, match=r"algorithm\.advantage_std"):
                AlgorithmConfig(advantage=name, advantage_std="sample")


# --- under a discount: the batch-scaled estimators split as grpo does ------------------------


def split_reference(sessions: list[SessionReturns], centred_spread: bool) -> list[list[float]]:
    """The module docstring's rule with the batch's statistics: each session one group of its
    own key, path turns only. A = (U - group mean U) / (s + eps) + (D - group mean D) /
    max(s, batch mean |U|), D = G - U, s the batch std of U (LitePPO) or of U less its group's
    mean (REINFORCE++-baseline); at discount 1 (every G = U): (G - group mean) / (s + eps)."""
    length = max(len(s.returns) for s in sessions)

    def at(values, t):
        return values[t] if t < len(values) else values[-1]

    groups: dict[str, list[SessionReturns]] = {}
    for s in sessions:
        groups.setdefault(s.group_key, []).append(s)
    out = []
    for me in sessions:
        mine = groups[me.group_key]
        advantages = []
        for t, (g, u) in enumerate(zip(me.returns, me.undiscounted, strict=True)):
            assert t < length
            gs = [at(s.returns, t) for s in mine]
            us = [at(s.undiscounted, t) for s in mine]
            if len(mine) < 2 or len(set(gs)) == 1:
                advantages.append(0.0)
                continue
            batch_u = [at(s.undiscounted, t) for s in sessions]
            if centred_spread:
                spread_of = []
                for members in groups.values():
                    values = [at(s.undiscounted, t) for s in members]
                    spread_of += [v - statistics.fmean(values) for v in values]
                spread = statistics.pstdev(spread_of)
            else:
                spread = statistics.pstdev(batch_u)
            if gs == us:
                advantages.append((g - statistics.fmean(gs)) / (spread + EPS))
                continue
            unit = max(spread, statistics.fmean(abs(x) for x in batch_u))
            if unit == 0:
                advantages.append(0.0)
                continue
            ds = [a - b for a, b in zip(gs, us, strict=True)]
            advantages.append(
                (u - statistics.fmean(us)) / (spread + EPS)
                + ((g - u) - statistics.fmean(ds)) / unit
            )
        out.append(advantages)
    return out


quarters = st.integers(-8, 8).map(lambda k: k / 4)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), discount=st.sampled_from([0.5, 0.9, 1.0]) | st.floats(0.1, 1))
def test_batch_scaled_estimators_under_a_discount_follow_the_rule(data, discount):
    sessions = []
    for g in range(data.draw(st.integers(1, 3))):
        for _ in range(data.draw(st.integers(1, 4))):
            turns = data.draw(st.integers(1, 3))
            reward = data.draw(quarters)
            sessions.append(
                SessionReturns(
                    group_key=f"g{g}",
                    task_key=None,
                    returns=turn_returns([None] * turns, reward, discount),
                    undiscounted=turn_returns([None] * turns, reward, 1.0),
                )
            )
    for name, centred_spread in (("lite_ppo", False), ("reinforce_pp_baseline", True)):
        got = session_advantages(sessions, name, None)
        want = split_reference(sessions, centred_spread)
        for a, b in zip(got, want, strict=True):
            assert close(a, b, 1e-9), (name, got, want)


# --- DAPO's soft overlong punishment, reward scale and clip ----------------------------------


def dapo_eq_13(length: int, l_max: int, l_cache: int) -> Fraction:
    """Eq. 13 of arXiv 2503.14476, exactly."""
    if length <= l_max - l_cache:
        return Fraction(0)
    if length <= l_max:
        return Fraction((l_max - l_cache) - length, l_cache)
    return Fraction(-1)


@settings(max_examples=500, deadline=None)
@given(l_max=st.integers(1, 5000), data=st.data())
def test_overlong_penalty_is_dapo_eq_13(l_max, data):
    l_cache = data.draw(st.integers(1, l_max))
    length = data.draw(st.integers(0, 2 * l_max + 2))
    got = overlong_penalty(length, l_max, l_cache)
    assert got == float(dapo_eq_13(length, l_max, l_cache))  # one correctly rounded division
    assert -1.0 <= got <= 0.0


def test_overlong_penalty_at_its_edges():
    assert overlong_penalty(12, 16, 4) == 0.0  # L_max - L_cache: still free
    assert overlong_penalty(13, 16, 4) == -0.25
    assert overlong_penalty(16, 16, 4) == -1.0
    assert overlong_penalty(17, 16, 4) == -1.0


@given(
    reward=st.floats(-1e6, 1e6),
    scale=st.floats(1e-3, 1e3),
    clip=st.none() | st.floats(1e-3, 1e3),
)
def test_rewards_are_scaled_then_clipped(reward, scale, clip):
    want = reward * scale if clip is None else min(clip, max(-clip, reward * scale))
    assert shaped_reward(reward, scale, clip) == want


def test_a_reward_that_is_no_number_is_not_clipped_into_one():
    assert math.isnan(shaped_reward(math.nan, 2.0, 1.0))
    assert shaped_reward(math.inf, 2.0, 1.0) == math.inf


# --- through the batch: claimed sessions to samples ------------------------------------------


def claimed(sid, reward, turns, group="g"):
    """A session of one row: a 2-token prompt, then per turn (tokens, own reward,
    finish_reason) its sampled tokens."""
    input_ids, mask, spans = [1, 1], [0, 0], []
    for k, (tokens, own, finish) in enumerate(turns):
        start = len(input_ids)
        input_ids += [3] * tokens
        mask += [1] * tokens
        spans.append(
            {
                "completion_id": f"{sid}-{k}",
                "turn_index": k,
                "start": start,
                "end": len(input_ids),
                "reward": own,
                "temperature": 1.0,
                "alternative": False,
                **({} if finish is None else {"finish_reason": finish}),
            }
        )
    row = {
        "row_index": 0,
        "input_ids": input_ids,
        "loss_mask": mask,
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "versions": [0 if m else -1 for m in mask],
        "turns": spans,
    }
    return {
        "session_id": sid,
        "task_id": "t",
        "group_id": group,
        "metadata": {},
        "reward": reward,
        "rows": [row],
    }


def rules(**algorithm):
    return Rules(
        algorithm=AlgorithmConfig(temperature=1.0, off_temperature="mask", **algorithm),
        policy_version=0,
        max_staleness=4,
    )


def advantages_of(batch):
    return {s.session_id: max(s.advantages, key=abs) for s in batch.samples}


def test_reward_scale_and_clip_reach_the_returns_and_the_figures_keep_the_rewards():
    sessions = [claimed("a", 3.0, [(2, None, "stop")]), claimed("b", -0.5, [(2, None, "stop")])]
    batch = build_batch(
        sessions, rules(advantage="dr_grpo", reward_scale=2.0, reward_clip=1.5), None
    )
    assert batch.rewards == [3.0, -0.5]  # as the grader gave them
    assert batch.returns == [1.5, -1.0]  # 3 * 2 clipped to 1.5; -0.5 * 2
    assert advantages_of(batch) == {"a": 1.25, "b": -1.25}


def test_overlong_filter_masks_cut_answers_and_counts_them():
    sessions = [
        claimed("a", 1.0, [(3, None, "stop"), (5, None, "length")]),
        claimed("b", 0.0, [(4, None, "length")]),
        claimed("c", 0.0, [(2, None, "stop")]),
    ]
    off = build_batch(sessions, rules(), None)
    assert off.masked[OVERLONG] == 0 and not off.dropped
    on = build_batch(sessions, rules(overlong_filter=True), None)
    assert on.masked[OVERLONG] == 5 + 4
    assert "overlong_filter" in on.dropped["b"]  # nothing else to train: dropped, with why
    a = next(s for s in on.samples if s.session_id == "a")
    assert sum(a.loss_mask) == 3  # its first turn still trains
    assert on.sampled_tokens == off.sampled_tokens  # every token accounted for
    assert masked_tokens(on, None) == {OVERLONG: 9}  # the step's figure masked/overlong


def test_the_soft_overlong_penalty_is_added_to_the_turn_s_reward():
    # L_max 8, L_cache 4: 6 tokens -> (4 - 6) / 4 = -0.5, 2 tokens -> 0
    sessions = [
        claimed("long", 1.0, [(6, None, "stop")]),
        claimed("short", 1.0, [(2, None, "stop")]),
    ]
    plain = build_batch(sessions, rules(advantage="dr_grpo"), None)
    assert plain.returns == [1.0, 1.0] and advantages_of(plain) == {"long": 0.0, "short": 0.0}
    shaped = rules(advantage="dr_grpo", overlong_max_tokens=8, overlong_cache_tokens=4)
    batch = build_batch(sessions, shaped, None)
    assert batch.returns == [0.5, 1.0]
    assert advantages_of(batch) == {"long": -0.25, "short": 0.25}
    # then each reward scaled and clipped on its own: the turn's -0.5 * 4 = -2, the session's
    # 1 * 4 = 4 clipped to 3
    both = rules(
        advantage="dr_grpo",
        overlong_max_tokens=8,
        overlong_cache_tokens=4,
        reward_scale=4.0,
        reward_clip=3.0,
    )
    assert build_batch(sessions, both, None).returns == [-2.0 + 3.0, 3.0]


def test_advantage_std_reaches_the_estimator():
    sessions = [claimed(k, r, [(2, None, "stop")]) for k, r in (("a", 1.0), ("b", 0.0), ("c", 0.0))]
    population = advantages_of(build_batch(sessions, rules(), None))
    sample = advantages_of(build_batch(sessions, rules(advantage_std="sample"), None))
    rewards = [1.0, 0.0, 0.0]
    assert close([sample["a"]], [(1 - 1 / 3) / (statistics.stdev(rewards) + EPS)])
    assert close([population["a"]], [(1 - 1 / 3) / (statistics.pstdev(rewards) + EPS)])


# --- the server says which answers the length limit cut --------------------------------------


def test_rows_carry_each_turn_s_finish_reason():
    def turn(cid, index, prompt, completion, finish):
        return TurnTokens(
            completion_id=cid,
            request_id=cid,
            turn_index=index,
            row_index=0,
            extends_previous=index > 0,
            messages=None,
            tools=None,
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=[-0.1] * len(completion),
            versions=[0] * len(completion),
            finish_reason=finish,
        )

    (row,) = assemble_rows(
        [turn("a", 0, [1], [2, 3], "length"), turn("b", 1, [1, 2, 3, 4], [5], "stop")]
    )
    assert [t["finish_reason"] for t in row.turns] == ["length", "stop"]


# --- config: bounds and examples -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"reward_scale": 0.0}, "reward_scale"),
        ({"reward_scale": -1.0}, "reward_scale"),
        ({"reward_scale": math.inf}, "reward_scale"),
        ({"reward_clip": 0.0}, "reward_clip"),
        ({"reward_clip": math.nan}, "reward_clip"),
        ({"overlong_max_tokens": 16}, "overlong_cache_tokens"),
        ({"overlong_cache_tokens": 4}, "overlong_max_tokens"),
        ({"overlong_max_tokens": 0, "overlong_cache_tokens": 0}, "overlong_max_tokens"),
        ({"overlong_max_tokens": 16, "overlong_cache_tokens": 0}, "overlong_cache_tokens"),
        ({"overlong_max_tokens": 16, "overlong_cache_tokens": 17}, "overlong_cache_tokens"),
        ({"advantage_std": "bessel"}, "advantage_std"),
        ({"advantage": "rloo", "advantage_std": "sample"}, "advantage_std"),
    ],
)
def test_bad_values_name_their_field(options, field):
    with pytest.raises(ConfigError, match=rf"^algorithm\.{field}:"):
        AlgorithmConfig(**options)


def test_everything_is_off_by_default():
    algo = AlgorithmConfig()
    assert (algo.advantage_std, algo.reward_scale, algo.reward_clip) == ("population", 1.0, None)
    assert not algo.overlong_filter
    assert algo.overlong_max_tokens is None and algo.overlong_cache_tokens is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lite_ppo", {"advantage": "lite_ppo"}),
        ("reinforce_pp_baseline", {"advantage": "reinforce_pp_baseline"}),
        ("dapo_overlong", {"overlong_filter": True, "overlong_max_tokens": 256}),
        ("dapo_overlong_penalty", {"overlong_filter": False, "overlong_cache_tokens": 64}),
        ("reward_shaping", {"reward_scale": 0.5, "reward_clip": 1.0}),
        ("grpo_sample_std", {"advantage_std": "sample"}),
    ],
)
def test_the_example_configs_load(name, expected):
    config = load_config(EXAMPLES / f"{name}.yaml", ["server=http://127.0.0.1:8000"])
    for key, value in expected.items():
        assert getattr(config.algorithm, key) == value, key


# --- shaping through the batch, for any rewards ----------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    scale=st.sampled_from([0.5, 2.0, 4.0]) | st.floats(0.01, 100),
    discount=st.sampled_from([1.0, 0.9]),
)
def test_scaling_every_reward_scales_dr_grpo_s_advantages(data, scale, discount):
    """Dr. GRPO's advantage is G - mean G, linear in the rewards: scaling every reward by k
    scales every advantage by k; a clip no reward reaches changes nothing."""
    sessions = []
    for k in range(data.draw(st.integers(2, 6))):
        turns = [
            (data.draw(st.integers(1, 3)), data.draw(st.none() | quarters), "stop")
            for _ in range(data.draw(st.integers(1, 3)))
        ]
        sessions.append(claimed(f"s{k}", data.draw(st.none() | quarters), turns))
    base = build_batch(sessions, rules(advantage="dr_grpo", discount=discount), None)
    scaled = build_batch(
        sessions, rules(advantage="dr_grpo", discount=discount, reward_scale=scale), None
    )
    loose = rules(advantage="dr_grpo", discount=discount, reward_scale=scale, reward_clip=3 * scale)
    clipped = build_batch(sessions, loose, None)  # |reward| <= 2 before the scale: never clipped
    assert base.rewards == scaled.rewards  # the figures keep the rewards as recorded
    for b, s, c in zip(base.samples, scaled.samples, clipped.samples, strict=True):
        assert close(s.advantages, [scale * a for a in b.advantages], 1e-12)
        assert c.advantages == s.advantages


@st.composite
def cut_or_not(draw):
    """Claimed sessions of one row each: turns of 0 to 6 sampled tokens, own rewards or none,
    each cut by the length limit, stopped, or from a server that does not say."""
    sessions = []
    for k in range(draw(st.integers(0, 8))):
        turns = [
            (
                draw(st.integers(0, 6)),
                draw(st.none() | quarters),
                draw(st.sampled_from(["length", "stop", "tool_calls", None])),
            )
            for _ in range(draw(st.integers(1, 3)))
        ]
        group = draw(st.sampled_from(["g1", "g2", "g3"]))
        sessions.append(claimed(f"s{k}", draw(st.none() | quarters), turns, group))
    return sessions


@settings(max_examples=300, deadline=None)
@given(
    sessions=cut_or_not(),
    advantage=st.sampled_from(["grpo", "reinforce_pp", "lite_ppo", "reinforce_pp_baseline"]),
    advantage_std=st.sampled_from(["population", "sample"]),
    discount=st.sampled_from([1.0, 0.9]),
    overlong_filter=st.booleans(),
    penalty=st.none() | st.tuples(st.integers(1, 6), st.integers(1, 6)),
    reward_scale=st.sampled_from([1.0, 0.5, 3.0]),
    reward_clip=st.none() | st.sampled_from([0.5, 2.0]),
    dynamic_sampling=st.booleans(),
)
def test_any_batch_under_the_new_options_is_samples_or_reasons(
    sessions,
    advantage,
    advantage_std,
    discount,
    overlong_filter,
    penalty,
    reward_scale,
    reward_clip,
    dynamic_sampling,
):
    longest, cache = (None, None) if penalty is None else (max(penalty), min(penalty))
    out = build_batch(
        sessions,
        rules(
            advantage=advantage,
            advantage_std=advantage_std,
            discount=discount,
            overlong_filter=overlong_filter,
            overlong_max_tokens=longest,
            overlong_cache_tokens=cache,
            reward_scale=reward_scale,
            reward_clip=reward_clip,
            dynamic_sampling=dynamic_sampling,
        ),
        None,
    )
    trained = {s.session_id for s in out.samples}
    for s in sessions:  # every session is trained or dropped with a reason, never both
        assert (s["session_id"] in trained) != (s["session_id"] in out.dropped)
    sampled = sum(len(s["rows"][0]["input_ids"]) - 2 for s in sessions)  # all but the prompt
    assert out.sampled_tokens == sampled
    cut = {
        (s["session_id"], i)
        for s in sessions
        for t in s["rows"][0]["turns"]
        for i in range(t["start"], t["end"])
        if t.get("finish_reason") == "length"
    }
    # every session here is masked before any drop (no bad reward, row limit or stale drop),
    # so every cut token is counted, whether its session then trains or is dropped
    assert out.masked[OVERLONG] == (len(cut) if overlong_filter else 0)
    for sample in out.samples:
        for i, in_loss in enumerate(sample.loss_mask):
            if in_loss:
                assert math.isfinite(sample.advantages[i])
                assert not (overlong_filter and (sample.session_id, i) in cut)
    assert all(math.isfinite(r) for r in out.rewards)
