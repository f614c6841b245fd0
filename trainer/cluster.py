"""Ray: start (or join) a cluster and run ``world_size`` workers as actors that act as one.

``ray.init()`` on this machine by default, ``ray.init(address=...)`` to join a cluster.

A local Ray is private to the run. Every Ray process (GCS, raylet, object manager, agents,
autoscaler monitor, driver and actors) listens on 127.0.0.1 only, and every call between them
carries a token that lives in the run's own temporary directory, so another user of the machine
cannot reach it either. Its processes and that directory are gone within seconds of the trainer's
end, however it ends (SIGKILL included): a watchdog (``trainer/watchdog.py``) cleans up when the
trainer's pipe to it closes. Nothing is written under the home directory.

Joining a cluster uses Ray's token authentication (``RAY_AUTH_MODE=token``, the token from
``cluster.auth_token_file``, ``$RAY_AUTH_TOKEN`` or ``$RAY_AUTH_TOKEN_PATH``); a cluster without
it is refused unless ``cluster.auth=none``.

``WorkerGroup`` calls a method on every worker at once and waits for all of them; it knows
nothing about what the workers compute.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from trainer import failpoints, watchdog
from trainer.config import ClusterConfig
from trainer.worker import Worker, WorkerSettings

log = logging.getLogger(__name__)

MARKER = "PROXRL_RAY_DIR"  # in every local Ray process's environment: the watchdog kills by it
_TOKEN = secrets.token_hex(32)  # one per process: Ray's C++ side caches the token it first reads


# Ray's AF_UNIX sockets lie at <dir>/session_<date>_<time>_<pid>/sockets/plasma_store, and a
# socket's path holds at most 107 bytes: under a long $TMPDIR Ray could not start.
RAY_DIR_MAX_CHARS = 40


def private_ray_dir() -> str:
    """A new directory only this user can enter (0700), short enough for Ray's socket paths:
    under $TMPDIR where that is short, else under /tmp or /dev/shm."""
    length = len("/proxrl-ray-") + 8  # mkdtemp's random part
    for base in (tempfile.gettempdir(), "/tmp", "/dev/shm"):
        if len(base) + length <= RAY_DIR_MAX_CHARS and os.access(base, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix="proxrl-ray-", dir=base)
    raise RuntimeError(
        f"no short writable temporary directory for Ray's sockets: $TMPDIR "
        f"({tempfile.gettempdir()}) is longer than {RAY_DIR_MAX_CHARS - length} characters "
        "and neither /tmp nor /dev/shm is writable"
    )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def actor_env() -> dict[str, str]:
    """What every worker's environment holds, whatever its node's: offline, and the crash
    tests' failpoint where one is set (trainer/failpoints.py)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    for name in (failpoints.VARIABLE, failpoints.DIRECTORY):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


class WorkerLost(RuntimeError):
    """A worker's process or node died: the group cannot go on (its collectives need every
    rank). ``proxrl train`` exits with this; run again, it resumes from the last checkpoint."""


class LocalRay:
    """A Ray runtime for the lifetime of a ``with`` block (local or joined).

    ``loopback_groups``: the workers' torch.distributed groups are on this machine only (no
    engine elsewhere joins them), so gloo and NCCL may listen on loopback too.
    """

    def __init__(self, config: ClusterConfig, num_cpus: float, loopback_groups: bool = True):
        self.config = config
        self.num_cpus = num_cpus
        self.loopback_groups = loopback_groups
        self.temp_dir: str | None = None
        self.watchdog: subprocess.Popen | None = None
        self._saved_env: dict[str, str | None] = {}

    def __enter__(self) -> LocalRay:
        ray = sys.modules.get("ray")  # not imported here: Ray reads some settings at import
        if ray is not None and ray.is_initialized():
            return self
        if self.config.address:
            self._join()
        else:
            try:
                self._start()
            except BaseException:
                self.__exit__()
                raise
        return self

    def _join(self) -> None:
        env = actor_env()
        # A cluster at 127.0.0.1 stays there (Ray would dial the machine's own address instead,
        # where a loopback head does not listen); other addresses are not rewritten anyway.
        self._set_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        if self.config.auth == "token":
            self._set_env(RAY_AUTH_MODE="token")
            if self.config.auth_token_file:
                self._set_env(RAY_AUTH_TOKEN_PATH=self.config.auth_token_file, RAY_AUTH_TOKEN=None)
        else:
            self._set_env(RAY_AUTH_MODE="disabled")
        import ray  # after the environment: Ray reads it at import

        ray.init(
            address=self.config.address,
            runtime_env={"env_vars": env},
            log_to_driver=True,
            configure_logging=False,
        )

    def _start(self) -> None:
        self.temp_dir = private_ray_dir()
        self.watchdog = watchdog.start(f"{MARKER}={self.temp_dir}", self.temp_dir)
        token_path = os.path.join(self.temp_dir, "auth_token")
        with open(os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(_TOKEN)
        self._set_env(
            **{MARKER: self.temp_dir},
            # Ray turns a node address of 127.0.0.1 into the machine's own address (and its
            # servers then listen on every interface) unless this is off; despite its name it
            # only decides that, on Linux too.
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=token_path,
            RAY_AUTH_TOKEN=None,
            RAY_USAGE_STATS_ENABLED="0",
        )
        env = actor_env()
        if self.loopback_groups:
            env |= {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        import ray  # after the environment: Ray reads it at import

        ray.init(
            num_cpus=max(1, int(self.num_cpus + 0.999)),
            include_dashboard=False,
            _temp_dir=self.temp_dir,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": env},
            log_to_driver=True,
            configure_logging=False,
        )
        address = ray.util.get_node_ip_address()
        if not is_loopback(address):  # ray was imported before RAY_ENABLE_... was set
            raise RuntimeError(f"local Ray would listen on {address}; import ray after LocalRay")

    def _set_env(self, **values: str | None) -> None:
        for name, value in values.items():
            self._saved_env.setdefault(name, os.environ.get(name))
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def __exit__(self, *exc: object) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            if self.watchdog is not None:
                assert self.watchdog.stdin is not None
                self.watchdog.stdin.close()  # what the trainer's death would do
                try:
                    self.watchdog.wait(30)
                except subprocess.TimeoutExpired:
                    log.warning("the Ray watchdog did not finish in 30 s")
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self._saved_env.clear()


class WorkerGroup:
    """``world_size`` ``Worker`` actors forming one torch.distributed group.

    Every call waits for all workers, but fails as soon as one of them dies (its peers may wait
    in a collective for it forever): :class:`WorkerLost`, naming the rank and its node."""

    SHUTDOWN_WAIT_S = 30.0

    def __init__(self, world_size: int, settings: WorkerSettings, config: ClusterConfig) -> None:
        import ray

        gpus = 1 if config.device == "cuda" else 0
        if config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= world_size:
            gpus = 1
        actor: Any = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=gpus)(Worker)
        threads = settings.threads or max(1, int(config.cpus_per_worker))
        settings = WorkerSettings(**{**settings.__dict__, "threads": threads})
        self.workers: list[Any] = [
            actor.remote(rank, world_size, settings) for rank in range(world_size)
        ]
        self.nodes: list[str] = ["an unknown node"] * world_size
        self.nodes = self.call("node")
        address, port = self._get([self.workers[0].address.remote()])[0]
        self.rank0_address: str = address
        self.info = self.call("setup", address, port)[0]
        log.info("%d worker(s) ready on %s: %s", world_size, ", ".join(self.nodes), self.info)

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """The results of ``refs`` (one per rank, in rank order), raising at the first failure
        (:class:`WorkerLost` where a worker died) instead of waiting for the others."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                raise TimeoutError(f"{len(pending)} worker call(s) unfinished after {timeout} s")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                rank = refs.index(done[0])
                raise WorkerLost(
                    f"training worker rank {rank} on {self.nodes[rank]} was lost "
                    f"({type(exc).__name__}): its process or its node died. Bring the node "
                    "back (or give the cluster that capacity again) and run proxrl train again: "
                    "it resumes from its last checkpoint and trains every session exactly once"
                ) from None
        return ray.get(refs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args)`` on every worker; the results in rank order."""
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank: list[tuple]) -> list[Any]:
        """``method(*per_rank[rank])`` on each worker; the results in rank order."""
        calls = [
            getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank, strict=True)
        ]
        return self._get(calls)

    def start(self, method: str, *args: Any) -> list[Any]:
        """Start ``method`` on every worker without waiting (Ray object refs)."""
        return [getattr(w, method).remote(*args) for w in self.workers]

    def wait(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """The results of refs from :meth:`start` (as ``call``: the first failure raises)."""
        return self._get(refs, timeout)

    def shutdown(self) -> None:
        """Leave the group and end the actors; a worker stuck in a collective whose peer died
        does not hold this past ``SHUTDOWN_WAIT_S``."""
        import ray

        try:
            self._get(self.start("shutdown"), self.SHUTDOWN_WAIT_S)
        except (WorkerLost, TimeoutError) as exc:
            log.warning("the workers did not leave their group: %s", exc)
        finally:
            for worker in self.workers:
                ray.kill(worker)
