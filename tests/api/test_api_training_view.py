"""What of the sampled tokens trained, as GET /rl/runs/{id} (``training``) and the dashboard's
JSON show it: the trainer's totals from its latest step (a mistyped one null, never a 500), every
dropped session by reason code (the server's own drops included), the run's min_trained_share,
and the warning below it, or, before any step, when the trainer dropped what it claimed. And the
trained mark of a claim no session carries: a 404.
"""

from __future__ import annotations

from server.common.trained_share import share_warning
from tests.api.api_support import Api, assert_error


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
    assert warning == share_warning(
        0.6, 100, {"stale": 30, "off_temperature": 5}, {"stale": 2}, 0.8
    )
    assert "60% of the 100 tokens" in warning and "min_trained_share 0.8" in warning
    assert "30 tokens masked as stale" in warning and "2 sessions dropped as stale" in warning
    assert "no_turns" not in warning  # the server's drops sampled no token the trainer counts

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


def test_a_mistyped_total_in_a_step_reads_as_null_never_a_500(api: Api):
    run_id = api.new_run(min_trained_share=0.9)["id"]
    metrics = {
        "total_sampled_tokens": "x",
        "total_trained_tokens": 1.5,
        "total_trained_share": "0.5",
        "total_masked_tokens": 3,
        "total_dropped_sessions": [2, 1],
    }
    api.ok(
        "POST", f"/rl/runs/{run_id}/steps", 201, json={"step": 1, "version": 1, "metrics": metrics}
    )
    training = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert {key: training[key] for key in metrics} == dict.fromkeys(metrics)
    assert training["warning"] is None  # no share to judge
    assert api.ok("GET", f"/admin/api/runs/{run_id}")["training"] == training
    (listed,) = [r for r in api.ok("GET", "/admin/api/runs")["items"] if r["id"] == run_id]
    assert listed["training"] == training

    metrics = {**step_metrics(100, 40), "total_masked_tokens": {"stale": 30, "greedy": -1}}
    api.ok(
        "POST", f"/rl/runs/{run_id}/steps", 201, json={"step": 2, "version": 2, "metrics": metrics}
    )
    training = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert training["total_masked_tokens"] is None and training["total_sampled_tokens"] == 100
    assert training["warning"] == share_warning(0.4, 100, {}, {"stale": 2}, 0.9)


def test_a_run_whose_every_batch_was_dropped_warns_before_any_step(api: Api):
    run_id = api.new_run(min_trained_share=0.9)["id"]
    empty = api.new_session(run_id, task_id="t")  # the server's drop: no_turns, no claim's
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/end")
    sids = [trainable_session(api, run_id) for _ in range(4)]
    claim = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 4})
    assert sorted(s["session_id"] for s in claim["sessions"]) == sorted(sids)
    reasons = {sids[0]: "no_trainable_tokens: 9 tokens, all masked", sids[1]: "no_contrast"}
    reasons |= {
        sid: f"no_trainable_tokens: {i} tokens, all masked" for i, sid in enumerate(sids[2:])
    }
    api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm", json={"dropped": reasons})

    training = api.ok("GET", f"/rl/runs/{run_id}")["training"]
    assert training["total_trained_share"] is None  # no step: a batch that trains nothing is none
    assert training["dropped_sessions"] == {
        "no_trainable_tokens": 3,
        "no_contrast": 1,
        "no_turns": 1,
    }
    assert training["warning"] == (
        "no step has trained anything yet; 4 sessions the trainer claimed were dropped: "
        "3 as no_trainable_tokens, 1 as no_contrast"
    )

    quiet = api.new_run(min_trained_share=0.9)["id"]  # only the server's drops: no warning
    empty = api.new_session(quiet, task_id="t")
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{empty['session_id']}/end")
    api.ok("POST", f"/rl/runs/{quiet}/claims", json={"max_sessions": 4})
    training = api.ok("GET", f"/rl/runs/{quiet}")["training"]
    assert training["dropped_sessions"] == {"no_turns": 1} and training["warning"] is None


def test_marking_a_claim_no_session_carries_trained_is_a_404(api: Api):
    reply = api.call("POST", "/rl/claims/claim-nope/trained", json={"version": 1})
    assert "claim-nope" in assert_error(reply, 404, code="claim_not_found")["message"]

    run_id = api.new_run()["id"]
    sids = [trainable_session(api, run_id) for _ in range(2)]
    claim_id = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 2})["claim_id"]
    trained = api.ok("POST", f"/rl/claims/{claim_id}/trained", json={"version": 1})
    assert trained == {"claim_id": claim_id, "trained": 2}
    api.ok("POST", f"/rl/claims/{claim_id}/confirm", json={"dropped": {sids[0]: "stale: late"}})
    settled = api.ok("POST", f"/rl/claims/{claim_id}/trained", json={"version": 2})
    assert settled == {"claim_id": claim_id, "trained": 0}  # known, every session settled

    released = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 2})["claim_id"]
    api.ok("POST", f"/rl/claims/{released}/release")  # released sessions carry no claim id
    reply = api.call("POST", f"/rl/claims/{released}/trained", json={"version": 2})
    assert_error(reply, 404, code="claim_not_found")
