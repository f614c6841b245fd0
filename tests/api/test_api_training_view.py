"""What of the sampled tokens trained, as GET /rl/runs/{id} (``training``) and the dashboard's
JSON show it: the trainer's totals from its latest step, every dropped session by reason code
(the server's own drops included), the run's min_trained_share, and the warning below it.
"""

from __future__ import annotations

from tests.api.api_support import Api


def trainable_session(api: Api, run_id: str) -> str:
    session = api.new_session(run_id, task_id="t")
    api.chat(session)
    sid = session["session_id"]
    api.ok("POST", f"/rl/sessions/{sid}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{sid}/end")
    return sid


def step_metrics(sampled: int, trained: int) -> dict:
    """A step's figures as the trainer posts them (trainer/figures.py step_record)."""
    return {
        "trained_share": 0.5,
        "total_sampled_tokens": sampled,
        "total_trained_tokens": trained,
        "total_trained_share": trained / sampled,
        "total_masked_tokens": {"stale": 30, "off_temperature": 5},
        "total_dropped_sessions": {"stale": 2},
    }


def test_the_run_view_counts_drops_by_reason_and_warns_below_min_trained_share(api: Api):
    run = api.new_run(min_trained_share=0.8)
    run_id = run["id"]
    before = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert before == {
        "total_sampled_tokens": None,
        "total_trained_tokens": None,
        "total_trained_share": None,
        "total_masked_tokens": None,
        "total_dropped_sessions": None,
        "dropped_sessions": {},
        "min_trained_share": 0.8,
        "warning": None,
    }

    empty = api.new_session(run_id, task_id="t")  # ended without a model call: no_turns
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/end")
    stale = [trainable_session(api, run_id) for _ in range(2)]
    claim = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 4})
    assert api.session(empty["session_id"])["status"] == "dropped"  # the server's own drop
    reasons = {sid: f"stale: tokens {i + 3} updates behind" for i, sid in enumerate(stale)}
    api.ok("POST", f"/rl/claims/{claim['claim_id']}/drop", json={"dropped": reasons})
    steps = f"/rl/runs/{run_id}/steps"
    body = {"step": 1, "version": 1, "metrics": step_metrics(100, 60)}
    api.ok("POST", steps, 201, json=body)

    training = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert training["dropped_sessions"] == {"no_turns": 1, "stale": 2}  # details after ':' differ
    assert training["total_trained_share"] == 0.6 and training["total_sampled_tokens"] == 100
    assert training["total_masked_tokens"] == {"stale": 30, "off_temperature": 5}
    warning = training["warning"]
    assert "60%" in warning and "min_trained_share (0.8)" in warning
    assert "30 tokens masked as stale" in warning and "1 sessions dropped as no_turns" in warning

    dashboard = api.ok("GET", f"/admin/api/runs/{run_id}")["training"]
    assert dashboard == training
    (listed,) = [r for r in api.ok("GET", "/admin/api/runs")["items"] if r["id"] == run_id]
    assert listed["training"]["warning"] == warning
    assert api.ok("GET", f"/admin/api/runs/{run_id}/series")["min_trained_share"] == 0.8

    body = {"step": 2, "version": 2, "metrics": step_metrics(200, 170)}  # 85%: above the level
    api.ok("POST", steps, 201, json=body)
    training = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert training["total_trained_share"] == 0.85 and training["warning"] is None


def test_min_trained_share_is_a_share_and_a_bad_one_is_a_422_naming_it(api: Api):
    run = api.new_run()
    assert run["config"]["min_trained_share"] == 0.9
    path = f"/rl/runs/{run['id']}"
    reply = api.call("PATCH", path, json={"config": {"min_trained_share": 1.5}})
    assert reply.status_code == 422 and "min_trained_share" in reply.text
    patched = api.ok("PATCH", path, json={"config": {"min_trained_share": 0.0}})
    assert patched["config"]["min_trained_share"] == 0.0


def test_the_run_page_shows_the_trained_share_and_the_warning(api: Api):
    run_id = api.new_run(min_trained_share=0.9)["id"]
    body = {"step": 1, "version": 1, "metrics": step_metrics(100, 50)}
    api.ok("POST", f"/rl/runs/{run_id}/steps", 201, json=body)
    page = api.call("GET", f"/admin/runs/{run_id}")
    assert page.status_code == 200, page.text
    assert 'id="training-warning"' in page.text and "50%" in page.text
    assert "masked: off_temperature 5 stale 30" in page.text
    runs = api.call("GET", "/admin/runs")
    assert runs.status_code == 200 and 'class="pill down"' in runs.text
