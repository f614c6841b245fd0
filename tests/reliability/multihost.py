"""A small deployment on one machine: hosts as Linux network namespaces on one bridge, and the
parts of a proxrl deployment each on its own host, for the replica drills
(tests/reliability/test_replicas_deployment.py, tests/reliability/test_leader_drill.py).

:class:`Network` makes a bridge in the root namespace with an address in a private /24
(10.77.N.0/24, N chosen so that no address or route of the machine is in it) and N hosts, each a
namespace with loopback up and one veth on the bridge at ``10.77.N.(i + 2)``. The test (the
"client host") and HAProxy stay in the root namespace, on the bridge's address ``.1``. Every
namespace, veth and bridge carries the prefix ``prx`` and a random suffix; a file under
:data:`STATE` records the pid that made them, so a later run removes what a killed run left
(:func:`remove_stale`) without touching a live run's. :meth:`Network.close` kills every process
still in its namespaces and removes them, the bridge and the veths; it runs on the way out of
the ``with`` block, the test failing or not.

The parts: :func:`start_postgres` (``tests.postgres.PostgresServer`` listening on its host's
address), :func:`start_engine` (one ``proxrl engine``), :class:`Replica` (one ``proxrl serve``
with ``--engines`` and ``--db``, startable again after a kill or a stop), and :class:`HAProxy`
(Debian's ``haproxy``, installed with apt-get when missing; round robin, health checks on
/health, retries on connection failures and empty responses, bounded timeouts, its counters read
from its stats socket). Each process logs to a file under the test's directory and dies with the
test's process (``die_with_parent``).

The leader drill (SIGKILL the leader replica during a weight swap) is
tests/reliability/test_leader_drill.py, on a deployment of its own built from these parts.
"""

from __future__ import annotations

import contextlib
import csv
import io
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from server.common.processes import ServerProcess
from tests.postgres import PostgresServer
from tests.support import ROOT

PREFIX = "prx"
STATE = Path("/run/proxrl-multihost")  # one file per live network: its suffix, its owner's pid
ADMIN_KEY = "multihost-drill-admin-key-0123456789abcdef"  # off loopback: 32+ characters
REPLICA_PORT = 8000
ENGINE_PORT = 30000
HAPROXY_PORT = 8080


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    return [
        line.split(":")[1].strip().split("@")[0]
        for line in ip("-o", "link", "show").stdout.splitlines()
    ]


def _remove(suffix: str) -> None:
    """Everything of the network ``suffix``: its namespaces' processes, namespaces, links."""
    for namespace in _namespaces():
        if namespace.startswith(f"{PREFIX}-{suffix}-"):
            pids = ip("netns", "pids", namespace, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "delete", namespace, check=False)
    for link in _links():
        if link.startswith((f"{PREFIX}b{suffix}", f"{PREFIX}v{suffix}")):
            ip("link", "delete", link, check=False)
    (STATE / suffix).unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Remove the networks whose owner is dead (a run killed before its cleanup); their
    suffixes. Namespaces or links with the prefix and no owner file are stale too."""
    STATE.mkdir(parents=True, exist_ok=True)
    live = set()
    for entry in STATE.iterdir():
        with contextlib.suppress(ValueError, OSError):
            if _alive(int(entry.read_text())):
                live.add(entry.name)
    found = {n.split("-")[1] for n in _namespaces() if n.startswith(f"{PREFIX}-")}
    found |= {
        link[len(PREFIX) + 1 : len(PREFIX) + 5]
        for link in _links()
        if link.startswith((f"{PREFIX}b", f"{PREFIX}v"))
    }
    found |= {entry.name for entry in STATE.iterdir()}
    stale = sorted(found - live)
    for suffix in stale:
        _remove(suffix)
    return stale


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.N.0/24 that no address or route of the machine overlaps."""
    used = []
    for line in ip("-4", "-o", "addr", "show").stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for line in ip("-4", "route", "show").stdout.splitlines():
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(line.split()[0], strict=False))
    for third in secrets.SystemRandom().sample(range(1, 255), 254):
        subnet = ipaddress.ip_network(f"10.77.{third}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise RuntimeError("no free 10.77.N.0/24 on this machine")


class Host:
    """One namespace on the bridge."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address

    def wrap(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.name]

    def start(
        self,
        label: str,
        argv: Sequence[str],
        url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/health",
    ) -> ServerProcess:
        """``argv`` run here as a child (``ip netns exec`` execs it: the child's pid is the
        server's), logging to ``log_dir/label.log``; not yet waited for."""
        process = ServerProcess(
            [*self.wrap(), *argv], url, log_dir / f"{label}.log", cwd=ROOT, env=env
        )
        process.name = label
        process.ready_path = ready_path
        return process


class Network:
    """A bridge and ``count`` hosts on it (see the module's docstring); a context manager that
    removes them all on the way out."""

    def __init__(self, count: int) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the multi-host drills make network namespaces: they run as root")
        remove_stale()
        self.suffix = secrets.token_hex(2)
        (STATE / self.suffix).write_text(str(os.getpid()))
        self.bridge = f"{PREFIX}b{self.suffix}"
        self.hosts: list[Host] = []
        try:
            subnet = _free_subnet()
            addresses = list(subnet.hosts())
            self.gateway = str(addresses[0])
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(count):
                self.hosts.append(self._host(i, str(addresses[i + 1])))
        except BaseException:
            self.close()
            raise

    def _host(self, i: int, address: str) -> Host:
        name = f"{PREFIX}-{self.suffix}-{i}"
        outside, inside = f"{PREFIX}v{self.suffix}{i}", f"{PREFIX}p{self.suffix}{i}"
        ip("netns", "add", name)
        ip("-n", name, "link", "set", "lo", "up")
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", name)
        ip("link", "set", outside, "master", self.bridge)
        ip("link", "set", outside, "up")
        ip("-n", name, "link", "set", inside, "name", "eth0")
        ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "route", "add", "default", "via", self.gateway)
        return Host(name, address)

    def close(self) -> None:
        _remove(self.suffix)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_postgres(host: Host) -> PostgresServer:
    """PostgreSQL on ``host``'s address, trusting the bridge's subnet."""
    return PostgresServer(host=host.address, wrap=host.wrap()).start()


def start_engine(host: Host, model_dir: Path, log_dir: Path, *extra: str) -> ServerProcess:
    argv = [
        sys.executable, "-m", "server.cli", "engine", "--model", str(model_dir),
        "--host", host.address, "--port", str(ENGINE_PORT), "--log-level", "warning", *extra,
    ]  # fmt: skip
    url = f"http://{host.address}:{ENGINE_PORT}"
    return host.start("engine", argv, url, log_dir, ready_path="/model_info").wait_ready(180)


class Replica:
    """One ``proxrl serve`` on ``host``: attached to ``engine_url``, on the store ``db``, its
    sessions' base URL ``public_url`` (the load balancer's); :meth:`start` again after
    :meth:`kill` or :meth:`stop`."""

    def __init__(
        self,
        host: Host,
        model_dir: Path,
        engine_url: str,
        db: str,
        public_url: str,
        log_dir: Path,
        *extra: str,
    ) -> None:
        self.host = host
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.url = f"http://{host.address}:{REPLICA_PORT}"
        self.starts = 0
        self.process: ServerProcess | None = None
        self.argv = [
            sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
            "--engines", engine_url, "--db", db, "--host", host.address,
            "--port", str(REPLICA_PORT), "--public-url", public_url,
            "--data-dir", str(log_dir / f"data-{host.name}"), "--log-level", "warning", *extra,
        ]  # fmt: skip

    def start(self) -> Replica:
        """Start it (not waited for: :meth:`wait_ready`)."""
        self.starts += 1
        label = f"replica-{self.host.address}-{self.starts}"
        env = {"PROXRL_ADMIN_KEY": ADMIN_KEY}
        self.process = self.host.start(label, self.argv, self.url, self.log_dir, env=env)
        self.process.ready_timeout = 180.0
        self.process.stop_timeout = 150.0  # its graceful shutdown: --graceful-shutdown-timeout-s
        return self

    def wait_ready(self, timeout: float = 180.0) -> Replica:
        assert self.process is not None
        self.process.wait_ready(timeout)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush."""
        assert self.process is not None
        self.process.process.kill()
        self.process.process.wait(timeout=30)
        self.process.stop()  # closes its log

    def terminate(self) -> float:
        """SIGTERM and wait for it to exit (its graceful shutdown); the seconds that took."""
        assert self.process is not None
        began = time.monotonic()
        self.process.process.send_signal(signal.SIGTERM)
        self.process.process.wait(timeout=self.process.stop_timeout)
        self.process.stop()
        return time.monotonic() - began

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def haproxy_binary() -> str:
    """Debian's haproxy, installed (apt-get) when missing, as make system-deps does."""
    found = shutil.which("haproxy")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["update", "-qq"], ["install", "-y", "-qq", "haproxy"]):
        subprocess.run(["apt-get", *command], check=True, capture_output=True, timeout=300, env=env)
    found = shutil.which("haproxy")
    if not found:
        raise RuntimeError("apt-get installed haproxy, yet there is no haproxy on PATH")
    return found


HAPROXY_CONFIG = """\
global
    maxconn 8192
    stats socket {stats} mode 600 level admin

defaults
    mode http
    timeout connect 1s
    # Longer than any answer takes on a loaded machine: a request cut by a timeout and sent
    # again while the first attempt still runs on another replica is two requests of one session
    # on two replicas at once, which the replicas do not yet order (issue 27 part 1).
    timeout client 300s
    timeout server 300s
    timeout http-request 10s
    timeout http-keep-alive 10s
    timeout queue 10s
    # A health check may wait 3 s: a busy replica (two cores for every part) is slow, not dead;
    # a dead one refuses connections at once and is out after 2 checks.
    timeout check 3s
    # A request whose replica refused the connection or closed it without a byte of answer
    # (killed, or gone in its graceful shutdown) goes to another one: 3 tries, each elsewhere.
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response junk-response 503
    option httpchk GET /health
    default-server inter 1s fastinter 500ms downinter 1s fall 2 rise 2

frontend proxrl
    bind {bind}
    default_backend replicas

backend replicas
{balance}
    # A new session is not retried once sent: the retry would make a second session, and
    # hold a second place under the run's admission bound.
    http-request disable-l7-retry if METH_POST {{ path /rl/sessions }}
{servers}
"""

# The request's session, as HAProxy 2.6 can name it: the id in a path-form request's path
# (/sessions/{id}/v1/...: there the id is the credential, and an agent may send a fixed key of
# its own), else the session id in X-Session-Id (sent beside a run's or the admin's key, which
# many sessions share), else its key: Authorization's (without "Bearer"), else x-api-key's
# (Anthropic's clients). A later rule that matches overrides an earlier one. The same key in
# either header hashes the same. tests/integration/test_lb_affinity.py holds the docs' blocks
# to these lines.
AFFINITY = """\
    http-request set-var(txn.affinity) req.hdr(x-api-key)
    http-request set-var(txn.affinity) req.hdr(authorization),regsub("^Bearer +","",i) if { req.hdr(authorization) -m found }
    http-request set-var(txn.affinity) req.hdr(x-session-id) if { req.hdr(x-session-id) -m found }
    http-request set-var(txn.affinity) path,field(3,/) if { path_beg /sessions/ }
    balance hash var(txn.affinity)
    hash-type consistent"""  # noqa: E501 (HAProxy's lines, as the docs show them)

# How HAProxy spreads requests over the replicas. "session": by the request's session
# (AFFINITY), consistent hashing, so a session stays on one replica while that replica is up
# and only a dead replica's sessions move; "roundrobin": each request to the next.
BALANCE = {
    "session": AFFINITY,
    "roundrobin": "    balance roundrobin",
}


class HAProxy:
    """HAProxy in the root namespace on the bridge's address in front of ``replicas``, spreading
    requests as ``balance`` says (:data:`BALANCE`)."""

    def __init__(
        self, gateway: str, replicas: Sequence[Replica], log_dir: Path, balance: str = "session"
    ) -> None:
        self.stats = log_dir / "haproxy.sock"
        self.url = f"http://{gateway}:{HAPROXY_PORT}"
        servers = "\n".join(
            f"    server r{i} {r.host.address}:{REPLICA_PORT} check" for i, r in enumerate(replicas)
        )
        config = log_dir / "haproxy.cfg"
        config.write_text(
            HAPROXY_CONFIG.format(
                stats=self.stats,
                bind=f"{gateway}:{HAPROXY_PORT}",
                balance=BALANCE[balance],
                servers=servers,
            )
        )
        binary = haproxy_binary()
        subprocess.run([binary, "-c", "-q", "-f", str(config)], check=True, timeout=30)
        self.process = ServerProcess(
            [binary, "-db", "-f", str(config)], self.url, log_dir / "haproxy.log"
        )
        self.process.name = "haproxy"

    def wait_ready(self, timeout: float = 30.0) -> HAProxy:
        self.process.wait_ready(timeout)
        return self

    def _stat(self) -> list[dict[str, str]]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
        return [row for row in rows if row["pxname"] == "replicas"]

    def counters(self) -> dict[str, int]:
        """The backend's totals from ``show stat``: retries (wretr), redispatches (wredis),
        5xx answered (hrsp_5xx), connection errors (econ), response errors (eresp)."""
        for row in self._stat():
            if row["svname"] == "BACKEND":
                keys = ("wretr", "wredis", "hrsp_5xx", "econ", "eresp")
                return {key: int(row[key] or 0) for key in keys}
        raise RuntimeError("no backend row in haproxy's stats")

    def statuses(self) -> dict[str, str]:
        """Each replica's state as HAProxy's health checks see it (UP, DOWN, UP 1/2, ...)."""
        return {
            row["svname"]: row["status"]
            for row in self._stat()
            if row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def stop(self) -> None:
        self.process.stop()


def wait_healthy(url: str, timeout: float) -> float:
    """Poll ``url``/health until 200; the seconds that took."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - began
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy within {timeout:.0f} s")
