"""The promotion gate's rule (``server.rl.promotion.promotable``) against a float64 reference
written from its statement: a version newer than the promoted one, not evicted, with at least
min_eval_sessions rewarded eval sessions whose mean is >= the promoted version's mean + margin
(any mean, where the promoted version has no eval session); the newest of them. The standings
come from the same summary the run view's eval figures use (``server.store.evaluation``), fed
random eval scores."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from server.rl.promotion import Standing, promotable
from server.store.evaluation import Score, summarize
from server.store.run_config import PromotionGate

# Rewards and margins on a grid of quarters: their float64 sums and means are exact, so a mean
# that meets the bar exactly is a tie, not a rounding accident, on both sides.
QUARTERS = st.integers(-8, 8).map(lambda q: q / 4)


def reference(
    promoted: int,
    rewards: dict[int, list[float]],
    margin: float,
    min_count: int,
    evicted: set[int],
) -> int | None:
    bar = np.float64(np.mean(rewards[promoted])) if rewards.get(promoted) else None
    passing = [
        version
        for version, values in rewards.items()
        if version > promoted
        and version not in evicted
        and len(values) >= min_count
        and (bar is None or np.float64(np.mean(values)) >= bar + np.float64(margin))
    ]
    return max(passing) if passing else None


def standings_of(rewards: dict[int, list[float]]) -> dict[int, Standing]:
    scores = [Score(v, None, r) for v, values in rewards.items() for r in values]
    _, versions = summarize(scores)
    return {f.version: Standing(f.count, f.mean) for f in versions}


@settings(max_examples=400, deadline=None)
@given(
    rewards=st.dictionaries(st.integers(0, 6), st.lists(QUARTERS, max_size=6), max_size=7),
    promoted=st.integers(0, 6),
    margin=QUARTERS,
    min_count=st.integers(1, 4),
    evicted=st.sets(st.integers(1, 6)),
)
def test_promotable_is_the_rule(rewards, promoted, margin, min_count, evicted):
    rewards = {v: values for v, values in rewards.items() if values}  # summaries skip empties
    gate = PromotionGate(margin=margin, min_eval_sessions=min_count)
    servable = set(range(7)) - evicted
    got = promotable(promoted, standings_of(rewards), gate, servable)
    assert got == reference(promoted, rewards, margin, min_count, evicted)


def test_the_promoted_version_without_eval_sessions_asks_only_the_count():
    gate = PromotionGate(margin=10.0, min_eval_sessions=2)
    standings = {1: Standing(2, -5.0), 2: Standing(1, 9.0)}
    assert promotable(0, standings, gate, {0, 1, 2}) == 1


def test_an_evicted_version_is_never_promoted_and_the_newest_passing_wins():
    gate = PromotionGate(margin=0.0, min_eval_sessions=1)
    standings = {0: Standing(3, 0.5), 1: Standing(1, 0.6), 2: Standing(1, 0.9), 3: Standing(1, 1)}
    assert promotable(0, standings, gate, {0, 1, 2, 3}) == 3
    assert promotable(0, standings, gate, {0, 1, 2}) == 2
    assert promotable(0, standings, gate, {0}) is None
    assert promotable(3, standings, gate, {0, 1, 2, 3}) is None  # only newer versions
