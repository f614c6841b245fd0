"""Production sessions and the promotion gate against a real ``proxrl serve`` on SQLite and on
PostgreSQL: the SQL that ends a production session ``served``, keeps it out of claims and
admission, and locks the run's row while a gate decides runs on each backend. The rule itself is
held to a float64 reference in tests/unit/test_promotion_rule.py and tests/api/."""

from __future__ import annotations

import pytest

from tests import eval_scenarios as scenarios
from tests.integration import test_eval_sessions_backends as eval_backends
from tests.integration.test_lora_runs import make_adapter

BOTH = pytest.mark.parametrize("proxy", ["sqlite", "postgres"], indirect=True, scope="module")
proxy = eval_backends.proxy  # proxrl serve on SQLite or on a fresh PostgreSQL database


@BOTH
def test_production_sessions_are_served_never_claimed_and_take_no_place(proxy):
    run = proxy.new_run(batch_size=1, max_staleness=0, admission_wait_s=0.2)["id"]
    production = [proxy.new_session(run, production=True) for _ in range(2)]
    training = proxy.new_session(run)
    refused = proxy.call("POST", "/rl/sessions", json={"run_id": run})
    assert refused.status_code == 429, refused.text
    for session in (*production, training):
        scenarios.chat(proxy, session)
    scenarios.reward(proxy, training["session_id"], 1.0)
    scenarios.reward(proxy, production[0]["session_id"], 0.5)
    for session in (*production, training):
        proxy.end(session["session_id"])
    assert scenarios.reward(proxy, production[1]["session_id"], 0.25)["status"] == "served"
    claim = proxy.ok("POST", f"/rl/runs/{run}/claims", json={"max_sessions": 10})
    assert [s["session_id"] for s in claim["sessions"]] == [training["session_id"]]
    assert proxy.ok("GET", f"/rl/runs/{run}")["sessions"] == {"claimed": 1, "served": 2}


@BOTH
def test_a_gate_promotes_on_an_eval_reward_and_by_hand(proxy, tmp_path):
    run = proxy.new_run(promotion={"margin": 0.0, "min_eval_sessions": 1})["id"]
    adapter = make_adapter(proxy.model_dir, tmp_path / "a1", 1)
    proxy.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": adapter})
    session = proxy.new_session(run, eval=True)
    scenarios.chat(proxy, session)
    assert proxy.ok("GET", f"/rl/runs/{run}")["promotion"]["promoted_version"] == 0
    scenarios.reward(proxy, session["session_id"], 1.0)
    gate = proxy.ok("GET", f"/rl/runs/{run}")["promotion"]
    assert (gate["promoted_version"], gate["promoted_count"], gate["promoted_mean"]) == (1, 1, 1.0)
    back = proxy.ok("POST", f"/rl/runs/{run}/promote", json={"version": 0})
    assert back["promotion"]["promoted_version"] == 0
    assert [c["version"] for c in back["promotion"]["candidates"]] == [1]
