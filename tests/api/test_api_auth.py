"""Who may call what, in-process: no key and unknown keys are 401s, a known key on something it
may not reach a 403, each in OpenAI's shape and before anything is looked up."""

from __future__ import annotations

import pytest

from tests.api.api_support import NO_KEY, Api, assert_error

ADMIN_ONLY = [
    ("GET", "/rl/runs", None),
    ("POST", "/rl/runs", {"name": "x"}),
    ("GET", "/rl/sessions", None),
    ("GET", "/admin/engines", None),
    ("POST", "/admin/weights", {"model_path": "x"}),
    ("POST", "/rl/claims/renew", {"claim_ids": [], "lease_s": 10}),
    ("GET", "/admin/api/runs", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ONLY)
def test_admin_routes_refuse_every_other_caller(api: Api, method, path, body):
    run = api.new_run()
    session = api.new_session(run["id"])
    assert_error(api.call(method, path, key=NO_KEY, json=body), 401)
    reply = api.call(method, path, key="proxrl-sess-not-issued", json=body)
    assert_error(reply, 401, code="invalid_api_key")
    assert_error(api.call(method, path, key=run["api_key"], json=body), 403)
    assert_error(api.call(method, path, key=session["api_key"], json=body), 403)


def test_an_unknown_key_is_a_401_on_the_openai_routes(api: Api):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    reply = api.call("POST", "/v1/chat/completions", key="sk-not-issued", json=body)
    assert_error(reply, 401, code="invalid_api_key")
    assert_error(api.call("POST", "/v1/chat/completions", key=NO_KEY, json=body), 401)
    assert_error(api.call("GET", "/v1/models", key=NO_KEY), 401, code="invalid_api_key")


def test_a_session_key_reaches_only_its_own_session(api: Api):
    mine, theirs = api.new_session(), api.new_session()
    key = mine["api_key"]
    assert api.ok("GET", f"/rl/sessions/{mine['session_id']}", key=key)["turns"] == []
    assert_error(api.call("GET", f"/rl/sessions/{theirs['session_id']}", key=key), 403)
    reward = {"reward": 1.0}
    path = f"/rl/sessions/{theirs['session_id']}/reward"
    assert_error(api.call("POST", path, key=key, json=reward), 403)
    assert api.session(theirs["session_id"])["reward"] is None
    assert_error(api.call("POST", "/rl/sessions", key=key, json={}), 403)


def test_a_run_key_creates_and_reads_sessions_only_in_its_run(api: Api):
    run, other = api.new_run(), api.new_run()
    created = api.new_session(key=run["api_key"])  # no run_id: the key's own run
    assert created["run_id"] == run["id"]
    assert api.ok("GET", f"/rl/runs/{run['id']}", key=run["api_key"])["id"] == run["id"]
    reply = api.call("POST", "/rl/sessions", key=run["api_key"], json={"run_id": other["id"]})
    assert_error(reply, 403)
    assert_error(api.call("GET", f"/rl/runs/{other['id']}", key=run["api_key"]), 403)
    elsewhere = api.new_session(other["id"])
    reply = api.call("GET", f"/rl/sessions/{elsewhere['session_id']}", key=run["api_key"])
    assert_error(reply, 403)


def test_a_session_cannot_be_created_without_a_key(api: Api):
    assert_error(api.call("POST", "/rl/sessions", key=NO_KEY, json={}), 401)
