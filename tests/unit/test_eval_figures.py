"""The pure part of evaluation figures (``server.store.evaluation``): a session's score from its
rewards, and the per (version, task) and per-version figures against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest

from server.store.evaluation import Score, session_score, summarize


def test_a_session_reward_wins_over_turn_rewards_else_their_mean():
    assert session_score({"session": 0.25, "cmpl-1": 1.0}) == 0.25
    assert session_score({"cmpl-1": 1.0, "cmpl-2": 0.0, "cmpl-3": 0.5}) == 0.5
    assert session_score({}) is None


def test_figures_match_numpy_and_are_ordered_by_version_then_task():
    rng = np.random.default_rng(0)
    tasks = [None, "b", "a"]
    scores = [
        Score(int(rng.integers(0, 4)), tasks[int(rng.integers(0, 3))], float(rng.normal()))
        for _ in range(500)
    ]
    by_task, by_version = summarize(scores)
    keys = [(f.version, f.task_id) for f in by_task]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1] is not None, k[1] or ""))
    assert [f.version for f in by_version] == sorted({s.version for s in scores})
    assert all(f.task_id is None for f in by_version)
    for figure in by_task + by_version:
        values = np.asarray(
            [
                s.reward
                for s in scores
                if s.version == figure.version
                and (figure in by_version or s.task_id == figure.task_id)
            ],
            dtype=np.float64,
        )
        assert figure.count == len(values)
        assert figure.mean == pytest.approx(values.mean(), rel=0, abs=1e-12)
        assert figure.std == pytest.approx(values.std(ddof=0), rel=0, abs=1e-12)
        assert (figure.min, figure.max) == (values.min(), values.max())


def test_one_session_has_no_spread_and_none_gives_nothing():
    (one,), (total,) = summarize([Score(3, "t", -0.5)])
    assert (one.count, one.mean, one.std, one.min, one.max) == (1, -0.5, 0.0, -0.5, -0.5)
    assert (total.version, total.task_id, total.count) == (3, None, 1)
    assert summarize([]) == ([], [])
