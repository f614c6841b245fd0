"""/health, /metrics and /v1/models of the in-process app; /metrics also on an app that binds a
public address (where it needs the admin key)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.api.api_support import NO_KEY, Api, assert_error

STRONG_ADMIN_KEY = "api-tier-0123456789abcdefghijklmnopqrstuvwxyz"


def test_health_counts_the_engine_in_rotation(api: Api):
    reply = api.call("GET", "/health", key=NO_KEY)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"status": "ok", "engines_healthy": 1}


def test_models_names_the_served_model_to_any_issued_key(api: Api):
    session = api.new_session()
    listing = api.ok("GET", "/v1/models", key=session["api_key"])
    (card,) = listing["data"]
    assert listing["object"] == "list"
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "proxrl"
    assert card["max_model_len"] == api.ok("GET", "/admin/engines")[0]["context_length"]


def test_metrics_on_loopback_are_open_and_count_requests_by_route(api: Api):
    api.call("GET", "/rl/runs/run-missing")
    reply = api.call("GET", "/metrics", key=NO_KEY)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    wanted = 'proxrl_http_requests_total{method="GET",route="/rl/runs/{run_id}",status="404"}'
    (line,) = [line for line in reply.text.splitlines() if line.startswith(wanted)]
    assert float(line.split()[-1]) >= 1


@pytest.fixture(scope="module")
def public(tiny_model_dir, engine, tmp_path_factory) -> Iterator[TestClient]:
    """An app whose settings bind every address (it never listens: TestClient calls it)."""
    from server.main import create_app
    from server.settings import ServerSettings

    settings = ServerSettings(
        model=str(tiny_model_dir),
        engines=engine.url,
        data_dir=tmp_path_factory.mktemp("api-public"),
        host="0.0.0.0",
        admin_key=STRONG_ADMIN_KEY,
        log_level="warning",
    )
    with TestClient(create_app(settings)) as client:
        yield client


def test_metrics_off_loopback_need_the_admin_key(public: TestClient):
    assert_error(public.get("/metrics"), 401)
    assert_error(public.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    reply = public.get("/metrics", headers={"Authorization": f"Bearer {STRONG_ADMIN_KEY}"})
    assert reply.status_code == 200 and "proxrl_http_requests_total" in reply.text
