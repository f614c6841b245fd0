"""Evaluation sessions in the in-process API tier: never claimed, never counted against
admission, refused in a group of training sessions, their rewards by policy version and task in
GET /rl/runs/{id} (against a float64 reference), their fate at the reward deadline, and bad
input refused in our error shape.

This module publishes weights (new policy versions), so it runs an engine and a proxy of its
own: the tier's shared engine keeps serving version 0 to the other modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import eval_scenarios as scenarios
from tests.api.api_support import Api, assert_error
from tests.api.conftest import app_with_own_engine

SWEEP_INTERVAL_S = 0.2


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Api]:
    data_dir = tmp_path_factory.mktemp("api-eval")
    with app_with_own_engine(tiny_model_dir, data_dir, sweep_interval_s=SWEEP_INTERVAL_S) as (
        app,
        _,
    ):
        yield app


def test_eval_sessions_are_never_claimed(api):
    scenarios.eval_sessions_are_never_claimed(api)


def test_eval_sessions_are_admitted_at_a_full_staleness_bound(api):
    scenarios.eval_sessions_are_admitted_at_the_bound(api)


def test_a_group_id_is_all_eval_sessions_or_none(api):
    scenarios.a_group_is_all_eval_or_none(api)


def test_eval_rewards_by_version_and_task_match_a_float64_reference(api):
    scenarios.eval_rewards_by_version_and_task(api, api.model_dir)


def test_an_eval_session_with_no_run_figures_shows_empty_lists(api):
    run = api.new_run()
    assert run["eval"] == {"tasks": [], "versions": []}
    assert api.ok("GET", f"/rl/runs/{run['id']}")["eval"] == {"tasks": [], "versions": []}


def test_at_the_reward_deadline_eval_sessions_are_evaluated_or_dropped_never_defaulted(api):
    """Turn rewards make an eval session evaluated even where the run says they do not suffice
    (the training session beside it stays unrewarded and gets the default reward); an eval
    session without any reward is dropped, not given the default reward."""
    run = api.new_run(reward_timeout_s=0.5, on_missing_reward="default", default_reward=0.0)
    turn_rewarded = scenarios.new_session(api, run["id"], eval=True)
    completion = scenarios.chat(api, turn_rewarded)["id"]
    scenarios.reward(api, turn_rewarded["session_id"], 0.75, completion)
    unrewarded = scenarios.new_session(api, run["id"], eval=True)
    scenarios.chat(api, unrewarded)
    training = scenarios.new_session(api, run["id"])
    scenarios.chat(api, training)
    for session in (turn_rewarded, unrewarded, training):
        assert scenarios.end(api, session["session_id"]) == "ended"
    deadline = time.monotonic() + 10
    while api.session(unrewarded["session_id"])["status"] == "ended":
        assert time.monotonic() < deadline, "the reward deadline was never applied"
        time.sleep(0.1)
    time.sleep(3 * SWEEP_INTERVAL_S)
    dropped = api.session(unrewarded["session_id"])
    assert dropped["status"] == "dropped" and dropped["rewards"] == {}
    assert dropped["drop_reason"].startswith("no_reward:")
    evaluated = api.session(turn_rewarded["session_id"])
    assert evaluated["status"] == "evaluated" and evaluated["rewards"] == {completion: 0.75}
    version = evaluated["turns"][0]["versions"][0]  # the engine's: other tests publish weights
    trained = api.session(training["session_id"])
    assert trained["status"] == "trainable" and trained["reward"] == 0.0
    figures = api.ok("GET", f"/rl/runs/{run['id']}")["eval"]["versions"]
    assert [(f["version"], f["count"], f["mean"]) for f in figures] == [(version, 1, 0.75)]
    # an evaluated session still takes rewards, and its session reward now counts
    assert scenarios.reward(api, turn_rewarded["session_id"], 1.0)["status"] == "evaluated"
    figures = api.ok("GET", f"/rl/runs/{run['id']}")["eval"]["versions"]
    assert [(f["version"], f["count"], f["mean"]) for f in figures] == [(version, 1, 1.0)]


@pytest.mark.parametrize("value", ["yes", 1, "true", None, [True]])
def test_eval_must_be_a_json_boolean(api, value):
    reply = api.call("POST", "/rl/sessions", json={"eval": value})
    error = assert_error(reply, 422)
    assert "eval" in (error["param"] or "") + error["message"], error


def test_eval_defaults_to_false_and_is_shown(api):
    session = api.new_session()
    shown = api.session(session["session_id"])
    assert shown["eval"] is False
    listed = api.ok("GET", "/rl/sessions", params={"run_id": shown["run_id"], "limit": 5})
    assert all(item["eval"] is False for item in listed)
