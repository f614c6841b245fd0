"""The demo's evaluation sets without a server: fixed and distinct, the held-out one never in
the training stream, the seen one in it; the per-version figures and their comparison with the
server's ``eval`` rows."""

from __future__ import annotations

import itertools
import statistics

import pytest

from tests.support import example_agent_module

arithmetic = example_agent_module("arithmetic")
heldout = example_agent_module("heldout")


def names(problems) -> set[str]:
    return {problem.task_id for problem in problems}


def test_the_sets_are_fixed_distinct_disjoint_and_of_the_size_asked():
    sets = heldout.evaluation_sets(32)
    assert sets == heldout.evaluation_sets(32)
    assert list(sets) == ["heldout", "seen"]
    held, seen = sets["heldout"], sets["seen"]
    assert len(names(held)) == len(names(seen)) == 32 and not names(held) & names(seen)
    assert heldout.evaluation_sets(10)["heldout"] == held[:10]  # a smaller set is a prefix
    every = heldout.evaluation_sets(50)
    assert len(names(every["heldout"]) | names(every["seen"])) == 100  # every plain problem
    for size in (0, 51):
        with pytest.raises(ValueError, match="1 to 50"):
            heldout.evaluation_sets(size)


def test_training_never_sees_a_heldout_problem_and_sees_every_seen_one():
    sets = heldout.evaluation_sets(32)
    held = sets["heldout"]
    stream = heldout.training_problems(arithmetic.problems(0), held)
    training = list(itertools.islice(stream, 2000))
    assert not names(held) & names(training)
    assert names(sets["seen"]) <= names(training)
    assert len(names(training)) == 100 - 32  # every other one comes
    unfiltered = (p for p in arithmetic.problems(0) if p.task_id not in names(held))
    assert training == list(itertools.islice(unfiltered, 2000))


def answer(version: int, reward: float, task_id: str = "heldout"):
    return heldout.Answer(task_id, arithmetic.generate(1, 0)[0], "", reward, version)


def test_by_version_groups_one_sets_answers_by_the_version_that_gave_them():
    rewards = {3: [1.0, 0.0, 1.0], 0: [0.0, 1.0], 7: [1.0]}
    answers = [answer(v, r) for v, values in rewards.items() for r in values]
    answers += [answer(3, 0.0, "seen"), answer(9, 1.0, "seen")]
    assert heldout.by_version(answers, "seen") == [
        {"version": 3, "count": 1, "mean": 0.0},
        {"version": 9, "count": 1, "mean": 1.0},
    ]
    assert heldout.by_version(reversed(answers), "heldout") == [
        {"version": v, "count": len(rewards[v]), "mean": statistics.fmean(rewards[v])}
        for v in (0, 3, 7)
    ]


def test_the_servers_rows_are_read_for_the_heldout_task_and_compared():
    ours = [{"version": 0, "count": 2, "mean": 0.5}, {"version": 4, "count": 3, "mean": 2 / 3}]
    tasks = [
        {"version": 4, "task_id": "heldout", "count": 3, "mean": 2 / 3, "std": 0.47},
        {"version": 0, "task_id": "other", "count": 9, "mean": 0.1, "std": 0.3},
        {"version": 0, "task_id": "heldout", "count": 2, "mean": 0.5, "std": 0.5},
    ]
    totals = [{"version": 0, "task_id": None, "count": 11, "mean": 0.18, "std": 0.38}]
    run = {"eval": {"tasks": tasks, "versions": totals}}
    theirs = heldout.server_by_version(run, "heldout")
    assert theirs == ours
    assert heldout.disagreements(ours, theirs) == []
    assert heldout.server_by_version(run, "seen") == []
    assert heldout.server_by_version({}, "heldout") == []

    off = [{"version": 0, "count": 2, "mean": 0.5}, {"version": 5, "count": 3, "mean": 2 / 3}]
    assert heldout.disagreements(ours, off) == [
        "version 4: only the demo",
        "version 5: only the server",
    ]
    wrong = [{"version": 0, "count": 2, "mean": 0.5}, {"version": 4, "count": 3, "mean": 0.6}]
    (difference,) = heldout.disagreements(ours, wrong)
    assert difference.startswith("version 4: demo 3 answers, mean 0.666667; server 3")
