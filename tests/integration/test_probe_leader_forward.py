"""``POST /admin/weights/probe`` on a follower is answered by the leader: the leader is the
replica whose publishes check the trainer's files (``_check_files``) and drive the engines, so a
probe the load balancer sent to a follower must be read where a publish would be.

Replicas as in test_leader_replicas.py (its fixtures: the whole app in a thread per replica, over
one Postgres database, sharing one real embedded engine); ``probe`` is the real one, wrapped to
note which replica ran it.
"""

from __future__ import annotations

import secrets

import pytest

from server.common.weights_probe import PROBE_NAME
from server.rl import weights_probe
from tests.integration.test_leader_replicas import engine, start_replicas  # noqa: F401 (fixtures)


@pytest.mark.timeout(180)
def test_a_probe_sent_to_a_follower_is_read_by_the_leader(
    start_replicas,  # noqa: F811
    engine,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    _, (leader, follower) = start_replicas(2, health_interval_s=0.2)
    assert leader.leading and not follower.leading
    ran_on: list[str] = []
    real = weights_probe.probe

    async def noting(ctx, body):
        ran_on.append(ctx.replica_id)
        return await real(ctx, body)

    monkeypatch.setattr(weights_probe, "probe", noting)
    token = secrets.token_hex(16)
    path = tmp_path / PROBE_NAME
    path.write_text(token)
    reply = follower.post("/admin/weights/probe", json={"path": str(path), "token": token})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["readable"] is True
    assert [e["url"] for e in answer["engines"]] == [engine.url]
    assert ran_on == [leader.app.state.ctx.replica_id]  # the follower only forwarded

    # A request that is not a probe's is refused where it arrives, as on the leader.
    reply = follower.post("/admin/weights/probe", json={"path": "/etc/passwd", "token": token})
    assert reply.status_code == 422, reply.text
    assert PROBE_NAME in reply.json()["error"]["message"]
