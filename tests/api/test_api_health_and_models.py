"""/health, /metrics and /v1/models of the in-process app."""

from __future__ import annotations

from tests.api.api_support import NO_KEY, Api


def test_health_counts_the_engine_in_rotation(api: Api):
    reply = api.call("GET", "/health", key=NO_KEY)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"status": "ok", "engines_healthy": 1}
