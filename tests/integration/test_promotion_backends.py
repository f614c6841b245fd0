"""Production sessions and the promotion gate against a real ``proxrl serve`` on SQLite and on
PostgreSQL: the SQL that ends a production session ``served``, keeps it out of claims and
admission, and locks the run's row while a gate decides runs on each backend. The rule itself is
held to a float64 reference in tests/unit/test_promotion_rule.py and tests/api/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.test_lora_runs import make_adapter
from tests.support import ProxyProcess, RestClient

BOTH = pytest.mark.parametrize("proxy", ["sqlite", "postgres"], indirect=True, scope="module")


@dataclass
class Proxy(RestClient):
    process: ProxyProcess
    http: httpx.Client
    model_dir: Path

    def chat(self, session: dict) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        self.ok("POST", "/v1/chat/completions", key=session["api_key"], json=body)

    def reward(self, session: dict, value: float) -> dict:
        path = f"/rl/sessions/{session['session_id']}/reward"
        return self.ok("POST", path, json={"reward": value})


@pytest.fixture(scope="module")
def proxy(request, tiny_model_dir, tmp_path_factory):
    """``proxrl serve`` on SQLite or on a fresh PostgreSQL database (the test's parameter)."""
    backend = request.param
    extra = []
    if backend == "postgres":
        extra = ["--db", request.getfixturevalue("postgres").new_database()]
    data_dir = tmp_path_factory.mktemp(f"promotion-{backend}")
    with (
        ProxyProcess(tiny_model_dir, data_dir, *extra) as process,
        httpx.Client(base_url=process.url, timeout=120) as http,
    ):
        yield Proxy(process, http, tiny_model_dir)


@BOTH
def test_production_sessions_are_served_never_claimed_and_take_no_place(proxy):
    run = proxy.new_run(batch_size=1, max_staleness=0, admission_wait_s=0.2)["id"]
    production = [proxy.new_session(run, production=True) for _ in range(2)]
    training = proxy.new_session(run)
    refused = proxy.call("POST", "/rl/sessions", json={"run_id": run})
    assert refused.status_code == 429, refused.text
    for session in (*production, training):
        proxy.chat(session)
    proxy.reward(training, 1.0)
    proxy.reward(production[0], 0.5)
    for session in (*production, training):
        proxy.end(session["session_id"])
    assert proxy.reward(production[1], 0.25)["status"] == "served"
    claim = proxy.ok("POST", f"/rl/runs/{run}/claims", json={"max_sessions": 10})
    assert [s["session_id"] for s in claim["sessions"]] == [training["session_id"]]
    assert proxy.ok("GET", f"/rl/runs/{run}")["sessions"] == {"claimed": 1, "served": 2}


@BOTH
def test_a_gate_promotes_on_an_eval_reward_and_by_hand(proxy, tmp_path):
    run = proxy.new_run(promotion={"margin": 0.0, "min_eval_sessions": 1})["id"]
    adapter = make_adapter(proxy.model_dir, tmp_path / "a1", 1)
    proxy.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": adapter})
    session = proxy.new_session(run, eval=True)
    proxy.chat(session)
    assert proxy.ok("GET", f"/rl/runs/{run}")["promotion"]["promoted_version"] == 0
    proxy.reward(session, 1.0)
    gate = proxy.ok("GET", f"/rl/runs/{run}")["promotion"]
    assert (gate["promoted_version"], gate["promoted_count"], gate["promoted_mean"]) == (1, 1, 1.0)
    back = proxy.ok("POST", f"/rl/runs/{run}/promote", json={"version": 0})
    assert back["promotion"]["promoted_version"] == 0
    assert [c["version"] for c in back["promotion"]["candidates"]] == [1]
