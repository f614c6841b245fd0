"""The trainer across two nodes: a Ray head and a Ray worker node on two network-namespace
hosts, FSDP2 with one worker on each (gloo across the bridge), weights broadcast
(``publish.mode=distributed``) to an engine on a third host, ``proxrl serve`` and Postgres on a
fourth; then the worker node killed mid-step.

Hosts (``tests/reliability/multihost.py``), all on one bridge:

    head     ``ray start --head`` (token auth, 1 CPU) and the driver, ``proxrl train``
    node     ``ray start --address=head`` (token auth, 1 CPU)
    engine   ``proxrl engine``
    server   Postgres and ``proxrl serve --engines http://engine``

Each Ray node offers one CPU and each worker asks for one, so Ray can only place rank 0 and
rank 1 on different nodes. The host name resolves to 127.0.0.1 here, as on many machines, so
every gloo member (the Ray nodes' workers and the engine) is told its interface
(``GLOO_SOCKET_IFNAME=eth0``); the workers' rendezvous is rank 0's Ray node address.

A lost node: ``proxrl train`` exits nonzero naming the lost worker and its node; the node comes
back, ``proxrl train`` runs again and resumes from its last checkpoint; every session trains
exactly once (checked as tests/reliability/test_trainer_kills.py checks a killed trainer).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability import multihost
from tests.reliability.multihost import ADMIN_KEY, Host, Network, Replica
from tests.support import ROOT, AdminSessions
from tests.trainer_runs import Server, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RAY = Path(sys.executable).parent / "ray"
RAY_PORT = 6379
BATCH = 4
STALENESS = 8  # every session of a test is made before its trainer starts: room for them all
TOKEN = "c" * 32 + "0123456789abcdef" * 2
GLOO = {"GLOO_SOCKET_IFNAME": "eth0"}  # the host name resolves to loopback here


class RayNode:
    """``ray start`` on ``host`` (the head where ``head`` is None), token auth, one CPU; its
    processes are the host's: killing them all is killing the node."""

    def __init__(self, host: Host, token: Path, log_dir: Path, head: str | None = None):
        self.host, self.token, self.log_dir, self.head = host, token, log_dir, head
        self.temp_dirs: list[str] = []

    def start(self) -> float:
        """Start it; the seconds ``ray start`` took."""
        temp = tempfile.mkdtemp(prefix="proxrl-rn-")  # short: Ray's socket paths must fit
        self.temp_dirs.append(temp)
        where = ["--address", self.head]
        if self.head is None:
            where = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
        argv = [
            *self.host.wrap(), str(RAY), "start", *where, "--node-ip-address", self.host.address,
            "--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(200 * 2**20),
            "--disable-usage-stats", "--temp-dir", temp,
        ]  # fmt: skip
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
            **GLOO,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "HOME": str(self.log_dir),  # nothing under the real home directory
        }
        began = time.monotonic()
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        return time.monotonic() - began

    def kill(self) -> int:
        """SIGKILL every process on the host (raylet, workers, agents); how many."""
        pids = multihost.ip("netns", "pids", self.host.name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        return len(pids)

    def remove(self) -> None:
        for temp in self.temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)


class Proxy(AdminSessions):
    """What ``tests.trainer_runs.Server`` needs of a proxy, for the replica on its host."""

    ADMIN_KEY = ADMIN_KEY

    def __init__(self, url: str) -> None:
        self.url = url
        self.admin = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Cluster:
    network: Network
    head: RayNode
    node: RayNode
    engine_url: str
    server: Server
    log_dir: Path
    token: Path

    def load(self, count: int) -> list[str]:
        """``count`` finished sessions (a chat turn, a reward, the end) from 4 clients."""
        self.server.configure(batch_size=BATCH, max_staleness=STALENESS)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(self.server.episode, reward=float(i % 2)) for i in range(count)]
            return [f.result(timeout=300) for f in futures]

    def trainer(self, out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
        """``proxrl train`` on the head's host, joined to the cluster, two workers, weights
        broadcast from rank 0's node; its log in ``out/trainer-N.log``."""
        out.mkdir(parents=True, exist_ok=True)
        log = (out / f"trainer-{time.monotonic_ns()}.log").open("w")
        command = [
            *self.head.host.wrap(), sys.executable, "-m", "server.cli", "train",
            "--server", self.server.proxy.url, f"output_dir={out}", "lr=1e-3",
            "claim_wait_s=0.1", f"cluster.address={self.head.host.address}:{RAY_PORT}",
            f"cluster.auth_token_file={self.token}", "cluster.cpus_per_worker=1",
            "world_size=2", "publish.mode=distributed", "publish.master_address=",
            f"batch_size={BATCH}", f"max_staleness={STALENESS}", "checkpoint_every=1",
            *overrides,
        ]  # fmt: skip
        environment = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
            "PROXRL_ADMIN_KEY": ADMIN_KEY,
            "HF_HUB_OFFLINE": "1",
            "HOME": str(self.log_dir),
            **(env or {}),
        }
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environment,
            start_new_session=True,
        )  # fmt: skip
        process.log_path = Path(log.name)  # type: ignore[attr-defined]
        return process

    def served_versions(self) -> set[str | None]:
        rows = self.server.http.get("/admin/engines").json()
        return {row["weight_version"] for row in rows}


def wait_exit(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        raise
    return code, process.log_path.read_text()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("trainer-nodes")
    token = log_dir / "ray_token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with Network(4) as network:
        head_host, node_host, engine_host, server_host = network.hosts
        head = RayNode(head_host, token, log_dir)
        node = RayNode(node_host, token, log_dir, head=f"{head_host.address}:{RAY_PORT}")
        postgres = multihost.start_postgres(server_host)
        engine = replica = None
        try:
            argv = [
                sys.executable, "-m", "server.cli", "engine", "--model", str(tiny_model_dir),
                "--host", engine_host.address, "--port", str(multihost.ENGINE_PORT),
                "--log-level", "warning",
            ]  # fmt: skip
            engine_url = f"http://{engine_host.address}:{multihost.ENGINE_PORT}"
            engine = engine_host.start("engine", argv, engine_url, log_dir, env=GLOO)
            engine.ready_path = "/model_info"
            engine.wait_ready(180)
            url = f"http://{server_host.address}:{multihost.REPLICA_PORT}"
            replica = Replica(
                server_host, tiny_model_dir, engine_url, postgres.new_database(), url, log_dir
            )
            replica.start().wait_ready()
            head_s = head.start()
            node_s = node.start()
            print(f"\nray start: head {head_s:.1f} s, worker node {node_s:.1f} s")
            yield Cluster(network, head, node, engine_url, Server(Proxy(url)), log_dir, token)  # type: ignore[arg-type]
        finally:
            head.kill()
            node.kill()
            if replica is not None:
                replica.stop()
            if engine is not None:
                engine.stop()
            postgres.stop()
            head.remove()
            node.remove()


def test_fsdp2_across_two_nodes_publishes_to_an_engine_on_a_third(cluster, tmp_path):
    steps = 2
    sessions = cluster.load(BATCH * steps)
    out = tmp_path / "train"
    code, log = wait_exit(cluster.trainer(out, f"max_steps={steps}"), 600)
    assert code == 0, log[-5000:]
    # one worker on each node, and the group spans them
    ready = next(line for line in log.splitlines() if "worker(s) ready on" in line)
    assert (
        f"node {cluster.head.host.address} " in ready
        and f"node {cluster.node.host.address} " in ready
    )
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    trained = [s for r in records for s in r["session_ids"]]
    assert sorted(trained) == sorted(sessions)  # each once
    assert {cluster.server.statuses()[s] for s in sessions} == {"consumed"}
    version = cluster.server.run["policy_version"]
    assert version == records[-1]["version"]
    assert cluster.served_versions() == {str(version)}  # the engine serves what was broadcast
    # and samples with it: a new session's tokens carry the version (left open: untrainable)
    fresh = cluster.server.episode(reward=None, end=False)
    rows = cluster.server.get(fresh)["rows"]
    sampled = {
        v for row in rows for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m
    }
    assert sampled == {version}, rows
    print(f"\n2 nodes: {len(sessions)} sessions in {steps} steps, engine at version {version}")


def test_a_worker_node_killed_mid_step_resumes_and_trains_every_session_once(cluster, tmp_path):
    steps, kill_step = 3, 2
    sessions = cluster.load(BATCH * steps)
    out = tmp_path / "train"
    markers = tmp_path / "markers"
    markers.mkdir()
    failpoint = {
        "PROXRL_TRAINER_PAUSE_AT": f"mid_step@{kill_step}",
        "PROXRL_TRAINER_PAUSE_DIR": str(markers),
    }
    first = cluster.trainer(out, f"max_steps={steps}", env=failpoint)
    deadline = time.monotonic() + 600
    while not all((markers / f"paused-at-rank{r}").exists() for r in (0, 1)):
        assert first.poll() is None, first.log_path.read_text()[-5000:]  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the workers never reached the middle of a step"
        time.sleep(0.2)
    killed_at = time.monotonic()
    killed = cluster.node.kill()
    code, log = wait_exit(first, 300)
    exited_s = time.monotonic() - killed_at
    assert code == 1, log[-5000:]
    assert "was lost" in log and f"node {cluster.node.host.address} " in log, log[-5000:]
    before = metrics(out)
    assert [r["step"] for r in before] == list(range(1, kill_step))

    restarted = time.monotonic()
    cluster.node.start()
    second = cluster.trainer(out, f"max_steps={steps}")
    while len(metrics(out)) == len(before):
        assert second.poll() is None, second.log_path.read_text()[-5000:]  # type: ignore[attr-defined]
        assert time.monotonic() - restarted < 600, "no step after the restart"
        time.sleep(0.2)
    resumed_s = time.monotonic() - restarted
    code, log = wait_exit(second, 600)
    assert code == 0, log[-5000:]
    after = metrics(out)[len(before) :]
    assert after[0]["step"] == kill_step  # resumed from the checkpoint of the step before
    lineage = before + after
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))
    trained = [s for r in lineage for s in r["session_ids"]]
    assert sorted(trained) == sorted(sessions)  # each once, none lost
    assert {cluster.server.statuses()[s] for s in sessions} == {"consumed"}
    assert (out / "claims.jsonl").read_text() == ""
    version = cluster.server.run["policy_version"]
    assert version == lineage[-1]["version"] and cluster.served_versions() == {str(version)}
    figures = {
        "processes_killed": killed,
        "trainer_exit_s": round(exited_s, 1),
        "node_restart_to_first_step_s": round(resumed_s, 1),
        "sessions_finished": len(sessions),
        "sessions_trained": len(trained),
        "distinct_trained": len(set(trained)),
    }
    print("\nworker node killed mid-step:", json.dumps(figures))
