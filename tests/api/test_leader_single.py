"""A SQLite store's one server leads, with no lock: it swaps weights itself (nothing is
forwarded) and says so on ``GET /admin/leader`` and ``/metrics`` (server/store/leadership.py)."""

from __future__ import annotations

from tests.api.api_support import Api


def test_the_one_server_of_a_sqlite_store_leads(api: Api):
    view = api.ok("GET", "/admin/leader")
    assert view["leading"] is True
    assert view["leader"]["replica_id"] == view["replica_id"]
    assert view["leader"]["url"] == "http://127.0.0.1:8000"  # --advertise-url's default
    assert "proxrl_leader 1.0" in api.call("GET", "/metrics").text
    assert api.http.app.state.ctx.pool.leading  # type: ignore[attr-defined]


def test_who_leads_is_for_the_admin_only(api: Api):
    assert api.call("GET", "/admin/leader", key=None).status_code == 401
