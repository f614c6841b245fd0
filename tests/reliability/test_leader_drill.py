"""SIGKILL the leader replica in the middle of a weight swap, under load, multi-host: three
``proxrl serve`` replicas over one Postgres behind HAProxy, Postgres and the engine each on a
host of its own (tests/reliability/multihost.py, as in test_replicas_deployment.py, whose agents
this drill reuses: plain HTTP through HAProxy, every third turn streamed, retried on connection
errors, broken streams, 502, 503 and 504).

The first replica up leads, and only it has the swap failpoint (``PROXRL_WEIGHTS_FAILPOINT``
``paused:<s>``: its swaps wait that long with the engine paused, nothing loaded), so the kill
lands mid-swap every time: a caller asks for version 1 through HAProxy, the engine pauses (its
``/ready`` turns 503), and the leader is SIGKILLed. The caller retries what HAProxy could not,
with the same version, as the trainer does.

What must hold: another replica leads (the time from the kill is printed), the engine resumed
(nobody left paused), the swap done once by the new leader (the caller's retry) and the run's
``policy_version`` in the store equal to the engine's version; every turn a client was answered
is stored as answered, at a contiguous index, each stored token with one version, of 0 or 1,
never falling; no 500 anywhere and no session given up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from server.rl.weights import FAILPOINT
from tests.reliability import multihost
from tests.reliability.multihost import HAProxy, Network, Replica
from tests.reliability.test_replicas_deployment import (
    ADMIN,
    RETRY_STATUS,
    Deployment,
    Load,
    check_load,
    check_stored,
    create_sessions,
    new_run,
    run_load,
)

pytestmark = [pytest.mark.slow]

SESSIONS = 40
TURNS = 6
HOLD_S = 6.0  # the leader's swap waits this long paused: the kill lands inside it
FAILOVER_BOUND_S = 10.0  # --leader-check-s 1 and a loaded machine; the figure is printed
SWAP_RETRY_S = 90.0


@dataclass
class Drill(Deployment):
    engine_url: str = ""


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory) -> Iterator[Drill]:
    log_dir = tmp_path_factory.mktemp("leader-drill")
    with Network(5) as network:
        db_host, engine_host, *replica_hosts = network.hosts
        postgres = multihost.start_postgres(db_host)
        engine = haproxy = None
        replicas: list[Replica] = []
        try:
            db_url = postgres.new_database()
            engine = multihost.start_engine(
                engine_host, tiny_model_dir, log_dir, "--max-running-requests", "256"
            )
            public = f"http://{network.gateway}:{multihost.HAPROXY_PORT}"
            replicas = [
                Replica(host, tiny_model_dir, engine.url, db_url, public, log_dir)
                for host in replica_hosts
            ]
            with pytest.MonkeyPatch.context() as env:  # only the first (the leader) holds
                env.setenv(FAILPOINT, f"paused:{HOLD_S:g}")
                replicas[0].start().wait_ready()
            haproxy = HAProxy(network.gateway, replicas, log_dir, "session").wait_ready()
            result = Drill(network, db_url, replicas, haproxy, log_dir, engine.url)
            result.all_up()
            yield result
        finally:
            for replica in replicas:
                replica.stop()
            if haproxy is not None:
                haproxy.stop()
            if engine is not None:
                engine.stop()
            postgres.stop()


def leading(replica: Replica) -> bool:
    try:
        view = httpx.get(f"{replica.url}/admin/leader", headers=ADMIN, timeout=2)
    except httpx.HTTPError:
        return False
    return view.status_code == 200 and view.json()["leading"]


def engine_paused(engine_url: str) -> bool:
    return httpx.get(f"{engine_url}/ready", timeout=5).status_code == 503


class Caller:
    """The trainer's side: asks for ``version`` through HAProxy until a 200, retrying on
    502, 503 and 504 (after Retry-After), with the same version; every answer's status kept."""

    def __init__(self, url: str, model_path: str, run_id: str, version: int) -> None:
        self.url = url
        self.body = {"run_id": run_id, "model_path": model_path, "version": version}
        self.statuses: list[int] = []
        self.at: list[float] = []  # when each answer came (time.monotonic())
        self.answer: dict | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + SWAP_RETRY_S
        with httpx.Client(base_url=self.url, headers=ADMIN, timeout=120) as http:
            while time.monotonic() < deadline:
                try:
                    reply = http.post("/admin/weights", json=self.body)
                except httpx.TransportError:
                    self.statuses.append(0)
                    self.at.append(time.monotonic())
                    time.sleep(1)
                    continue
                self.statuses.append(reply.status_code)
                self.at.append(time.monotonic())
                if reply.status_code == 200:
                    self.answer = reply.json()
                    return
                if reply.status_code not in RETRY_STATUS:
                    return
                time.sleep(float(reply.headers.get("retry-after", "1")))


def wait_until(condition, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - began


def stored_versions(deployment: Deployment, load: Load) -> Counter:
    """Every answered session's stored tokens by version; each turn one version per token, never
    falling."""
    versions: Counter = Counter()
    with httpx.Client(base_url=deployment.haproxy.url, headers=ADMIN, timeout=60) as http:
        for session_id in load.answered:
            for turn in http.get(f"/rl/sessions/{session_id}").json()["turns"]:
                assert len(turn["versions"]) == len(turn["completion_ids"]), turn
                assert turn["versions"] == sorted(turn["versions"]), turn
                versions.update(turn["versions"])
    return versions


@pytest.mark.timeout(300)
def test_sigkill_the_leader_mid_swap_under_load(deployment: Drill, tiny_model_dir) -> None:
    began = time.monotonic()
    leader, *others = deployment.replicas
    assert leading(leader) and not any(map(leading, others))
    url = deployment.haproxy.url
    run_id = new_run(url, SESSIONS)
    sessions, statuses = asyncio.run(create_sessions(url, run_id, SESSIONS))
    assert statuses == Counter({201: SESSIONS}), statuses
    engine_url = deployment.engine_url
    before = deployment.haproxy.counters()
    load, stop = Load(), threading.Event()
    agents = run_load(url, sessions, load, stop, turns=TURNS)
    caller = Caller(url, str(tiny_model_dir), run_id, version=1)
    try:
        # streams (every session's second turn) in flight as the swap pauses the engine
        wait_until(
            lambda: load.turns() >= SESSIONS and load.streams_in_flight >= SESSIONS // 4,
            120,
            "the first turns and streams in flight",
        )
        caller.thread.start()
        wait_until(lambda: engine_paused(engine_url), 30, "the swap to pause the engine")
        time.sleep(1.0)  # the agents' requests pile up on the paused engine, streams among them
        streams, in_flight = load.streams_in_flight, len(load.in_flight)
        leader.kill()
        killed = time.monotonic()
        failover = wait_until(lambda: any(map(leading, others)), FAILOVER_BOUND_S, "a new leader")
        resumed = wait_until(lambda: not engine_paused(engine_url), 30, "the engine resumed")
        caller.thread.join(timeout=SWAP_RETRY_S + 30)
        swapped = time.monotonic() - killed
        agents.join(timeout=180)
        assert not agents.is_alive(), f"the agents did not finish: {load.turns()} turns"
    finally:
        stop.set()
        agents.join(timeout=60)
    assert caller.answer is not None, caller.statuses
    assert caller.answer["policy_version"] == 1
    assert all(status in (0, *RETRY_STATUS) for status in caller.statuses[:-1]), caller.statuses
    assert not engine_paused(engine_url)
    info = httpx.get(f"{engine_url}/model_info", timeout=5).json()
    run = httpx.get(f"{url}/rl/runs/{run_id}", headers=ADMIN, timeout=10).json()
    assert run["policy_version"] == 1 and info["weight_version"] == "1", (run, info)
    assert len([r for r in others if leading(r)]) == 1
    check_load(load)
    assert streams > 0, "no stream was in flight at the kill"
    assert load.turns() == SESSIONS * TURNS
    figures = check_stored(deployment, load, orphans_per_session=1)
    versions = stored_versions(deployment, load)
    assert set(versions) <= {0, 1} and versions[1] > 0, versions
    counters = deployment.haproxy.counters()
    answers = [
        (status, round(at - killed, 2))
        for status, at in zip(caller.statuses, caller.at, strict=True)
    ]
    outage = max(load.outages, default=0.0)
    print(
        f"\nSIGKILL the leader mid-swap: {SESSIONS} sessions x {TURNS} turns; {figures}; "
        f"client 5xx {load.fivexx()} (statuses {dict(load.statuses)}), transport errors "
        f"{dict(load.transport_errors)}, broken streams {load.broken_streams}; longest wait "
        f"from a failure to the answer {outage:.2f} s; in flight at the kill {in_flight} "
        f"(streams {streams}); failover {failover:.2f} s, engine resumed {resumed:.2f} s and "
        f"the swap answered {swapped:.2f} s after the kill; the caller's answers "
        f"{answers} (status, s after the kill), the new leader's pause "
        f"{caller.answer['pause_seconds']:.2f} s; tokens by version {dict(versions)}; haproxy "
        f"{ {k: counters[k] - before[k] for k in counters} }; wall "
        f"{time.monotonic() - began:.1f} s"
    )
