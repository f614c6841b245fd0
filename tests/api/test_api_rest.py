"""The RL REST surface in-process: runs, sessions, rewards, admission, claims, /admin; every
answer read back through the API itself."""

from __future__ import annotations

from tests.api.api_support import Api, assert_error


def trainable_session(api: Api, run_id: str, reward: float = 1.0, **fields) -> dict:
    """A session with one chat turn, rewarded and ended: trainable."""
    session = api.new_session(run_id, **fields)
    api.chat(session)
    api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": reward})
    assert api.ok("POST", f"/rl/sessions/{session['session_id']}/end")["status"] == "trainable"
    return session


def test_the_default_run_exists_from_the_start(api: Api):
    runs = api.ok("GET", "/rl/runs")
    defaults = [run for run in runs if run["is_default"]]
    assert len(defaults) == 1
    (default,) = defaults
    assert default["model"] == "tiny" and default["policy_version"] == 0
    assert default["model_path"] == str(api.model_dir)
    assert "api_key" not in default


def test_a_created_run_shows_its_key_once_and_its_whole_config(api: Api):
    created = api.new_run(batch_size=4, trainer_note="kept")
    assert created["api_key"] and not created["is_default"]
    shown = api.ok("GET", f"/rl/runs/{created['id']}")
    assert "api_key" not in shown
    assert shown["config"]["batch_size"] == 4 and shown["config"]["trainer_note"] == "kept"
    assert shown["config"]["temperature"] == 1.0  # a default, shown as it acts


def test_a_patch_merges_into_the_config_and_a_bad_value_is_a_422_naming_it(api: Api):
    run = api.new_run(batch_size=4)
    patched = api.ok("PATCH", f"/rl/runs/{run['id']}", json={"config": {"max_staleness": 3}})
    assert patched["config"]["batch_size"] == 4 and patched["config"]["max_staleness"] == 3
    reply = api.call("PATCH", f"/rl/runs/{run['id']}", json={"config": {"temperature": 7}})
    assert "temperature" in assert_error(reply, 422)["message"]
    assert api.ok("GET", f"/rl/runs/{run['id']}")["config"]["temperature"] == 1.0


def test_unknown_runs_and_sessions_are_404s(api: Api):
    assert_error(api.call("GET", "/rl/runs/run-missing"), 404, code="run_not_found")
    assert_error(api.call("GET", "/rl/sessions/sess-missing"), 404, code="session_not_found")
    reply = api.call("POST", "/rl/sessions", json={"run_id": "run-missing"})
    assert_error(reply, 404, code="run_not_found")


def test_a_session_keeps_what_it_was_created_with(api: Api):
    run = api.new_run()
    created = api.new_session(run["id"], task_id="t1", group_id="g1", metadata={"seed": 7})
    assert created["status"] == "open" and created["run_id"] == run["id"]
    shown = api.session(created["session_id"])
    assert (shown["task_id"], shown["group_id"], shown["metadata"]) == ("t1", "g1", {"seed": 7})
    assert shown["turns"] == [] and shown["turn_count"] == 0 and shown["reward"] is None


def test_sessions_are_listed_by_run_and_status(api: Api):
    run = api.new_run()
    open_one = api.new_session(run["id"])
    ended = trainable_session(api, run["id"])
    listed = api.ok("GET", "/rl/sessions", params={"run_id": run["id"]})
    assert {s["session_id"] for s in listed} == {open_one["session_id"], ended["session_id"]}
    trainable = api.ok("GET", "/rl/sessions", params={"run_id": run["id"], "status": "trainable"})
    assert [s["session_id"] for s in trainable] == [ended["session_id"]]


def test_a_reward_is_idempotent_and_a_different_one_conflicts(api: Api):
    session = api.new_session()
    path = f"/rl/sessions/{session['session_id']}/reward"
    first = api.ok("POST", path, json={"reward": 0.5})
    assert first["created"] and first["target"] == "session"
    assert not api.ok("POST", path, json={"reward": 0.5})["created"]
    assert_error(api.call("POST", path, json={"reward": 0.25}), 409)
    assert api.session(session["session_id"])["reward"] == 0.5


def test_a_turn_is_rewarded_by_its_completion_id(api: Api):
    session = api.new_session()
    answer = api.chat(session)
    path = f"/rl/sessions/{session['session_id']}/reward"
    rewarded = api.ok("POST", path, json={"reward": 1.0, "completion_id": answer["id"]})
    assert rewarded["target"] == answer["id"]
    shown = api.session(session["session_id"])
    assert shown["rewards"] == {answer["id"]: 1.0} and shown["turns"][0]["reward"] == 1.0
    reply = api.call("POST", path, json={"reward": 1.0, "completion_id": "chatcmpl-missing"})
    assert_error(reply, 404)


def test_a_reward_that_is_not_a_finite_number_in_bounds_is_a_422(api: Api):
    session = api.new_session()
    path = f"/rl/sessions/{session['session_id']}/reward"
    for body in ({"reward": "1"}, {"reward": 1e300}, {}, {"reward": 1.0, "extra": 1}):
        assert_error(api.call("POST", path, json=body), 422)
    assert api.session(session["session_id"])["reward"] is None


def test_a_full_run_refuses_a_session_with_429_and_retry_after(api: Api):
    run = api.new_run(batch_size=1, max_staleness=0, admission_wait_s=0)
    api.new_session(run["id"])
    reply = api.call("POST", "/rl/sessions", json={"run_id": run["id"]})
    assert_error(reply, 429, code="staleness_bound")
    assert int(reply.headers["Retry-After"]) >= 1
    assert api.ok("GET", f"/rl/runs/{run['id']}")["sessions"] == {"open": 1}


def test_a_claim_carries_the_rows_and_confirming_it_consumes_them(api: Api):
    run = api.new_run()
    session = trainable_session(api, run["id"], reward=0.75, task_id="rows")
    (turn,) = api.session(session["session_id"])["turns"]

    claim = api.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 4})
    (claimed,) = claim["sessions"]
    assert claimed["session_id"] == session["session_id"] and claimed["reward"] == 0.75
    (row,) = claimed["rows"]
    prompt, completion = turn["prompt_ids"], turn["completion_ids"]
    assert row["input_ids"] == prompt + completion
    assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
    assert row["logprobs"] == [0.0] * len(prompt) + turn["logprobs"]
    assert (
        api.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 4})["sessions"] == []
    )

    assert api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm")["consumed"] == 1
    assert api.session(session["session_id"])["status"] == "consumed"


def test_a_claim_request_is_validated_naming_the_field(api: Api):
    run = api.new_run()
    path = f"/rl/runs/{run['id']}/claims"
    for body, field in [
        ({"max_sessions": 0}, "max_sessions"),
        ({}, "max_sessions"),
        ({"max_sessions": 1, "lease_s": 0}, "lease_s"),
    ]:
        assert assert_error(api.call("POST", path, json=body), 422)["param"] == field


def test_admin_engines_lists_the_engine_the_proxy_attached_to(api: Api, engine):
    (row,) = api.ok("GET", "/admin/engines")
    assert row["url"] == engine.url and row["healthy"] and row["failures"] == 0
    assert row["context_length"] == engine.service.runner.context_length


def test_publishing_weights_that_do_not_load_is_a_400_and_serving_goes_on(api: Api, tmp_path):
    before = api.ok("GET", "/rl/runs")
    reply = api.call("POST", "/admin/weights", json={"model_path": str(tmp_path / "none")})
    assert assert_error(reply, 400)["param"] == "model_path"
    assert api.ok("GET", "/rl/runs") == before
    assert api.chat(api.new_session())["choices"]
    reply = api.call("POST", "/admin/weights", json={"run_id": "run-missing", "model_path": "x"})
    assert_error(reply, 404, code="run_not_found")


def test_a_weights_path_longer_than_the_run_can_record_is_a_422_before_any_pause(api: Api, engine):
    """A run records the path its version was loaded from (1,000 characters): a longer one was
    loaded, then failed at the record (Postgres: value too long) after the engines had been
    paused for it."""
    path = "/" + "d" * 1000
    reply = api.call("POST", "/admin/weights", json={"model_path": path})
    assert assert_error(reply, 422)["param"] == "model_path"
    assert engine.service.scheduler.paused is None
    assert api.chat(api.new_session())["choices"]
