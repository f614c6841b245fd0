"""Ray: start (or join) a cluster and run ``world_size`` workers as actors that act as one.

``ray.init()`` on this machine by default, ``ray.init(address=...)`` to join a cluster. A local
Ray gets a temporary directory of its own, binds loopback, and runs without token auth (Ray
2.60 turns it on by default and writes the token under the home directory), so a local run
leaves nothing behind. ``WorkerGroup`` calls a method on every worker at once and waits for all
of them; it knows nothing about what the workers compute.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

from trainer.config import ClusterConfig
from trainer.worker import Worker, WorkerSettings

log = logging.getLogger(__name__)


class LocalRay:
    """A Ray runtime for the lifetime of a ``with`` block (local or joined)."""

    def __init__(self, config: ClusterConfig, num_cpus: float) -> None:
        self.config = config
        self.num_cpus = num_cpus
        self.temp_dir: str | None = None

    def __enter__(self) -> LocalRay:
        import ray

        if ray.is_initialized():
            return self
        env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        if self.config.address:
            ray.init(
                address=self.config.address,
                runtime_env={"env_vars": env},
                log_to_driver=True,
                configure_logging=False,
            )
            return self
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only, see module doc
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.temp_dir = tempfile.mkdtemp(prefix="proxrl-ray-")
        ray.init(
            num_cpus=max(1, int(self.num_cpus + 0.999)),
            include_dashboard=False,
            _temp_dir=self.temp_dir,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": env},
            log_to_driver=True,
            configure_logging=False,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


class WorkerGroup:
    """``world_size`` ``Worker`` actors forming one torch.distributed group."""

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
        address, port = ray.get(self.workers[0].address.remote())
        self.info = self.call("setup", address, port)[0]
        log.info("%d worker(s) ready: %s", world_size, self.info)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args)`` on every worker; the results in rank order."""
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank: list[tuple]) -> list[Any]:
        """``method(*per_rank[rank])`` on each worker; the results in rank order."""
        import ray

        calls = [
            getattr(w, method).remote(*args) for w, args in zip(self.workers, per_rank, strict=True)
        ]
        return ray.get(calls)

    def start(self, method: str, *args: Any) -> list[Any]:
        """Start ``method`` on every worker without waiting (Ray object refs)."""
        return [getattr(w, method).remote(*args) for w in self.workers]

    def shutdown(self) -> None:
        import ray

        try:
            self.call("shutdown")
        finally:
            for worker in self.workers:
                ray.kill(worker)
