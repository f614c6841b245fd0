"""Wire a training run together: the server (attached or started here), Ray, workers, loop.

Everything started here is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from server.common.processes import ProxyProcess, die_with_parent
from trainer.checkpoint import TrainerState
from trainer.cluster import LocalRay, WorkerGroup, is_loopback
from trainer.config import TrainConfig
from trainer.loop import Trainer, describe_start, install_signal_handlers, worker_settings
from trainer.server_api import ServerAPI

log = logging.getLogger("proxrl.trainer")


class LocalServer(ProxyProcess):
    """``proxrl serve`` on loopback for a one-command local run: a fresh admin key of its own,
    its log in ``data_dir/server.log``; serving once constructed, stopped by ``stop()``."""

    name = "proxrl serve"

    def __init__(self, model_dir: str, data_dir: Path, timeout_s: float = 300.0) -> None:
        super().__init__(model_dir, data_dir, secrets.token_urlsafe(24))
        self.wait_ready(timeout_s)


class TrainerProcess:
    """``proxrl train`` as a subprocess attached to ``server`` (a ``LocalServer``), for scripts
    that drive an agent beside it (the demo, benchmarks). Its output goes to ``log_path``, its
    figures to ``output_dir/metrics.jsonl``; the admin key travels in the environment, never on
    the command line. ``stop()`` is Ctrl-C: the trainer finishes its step and checkpoints."""

    def __init__(
        self, server: LocalServer, output_dir: Path, overrides: list[str], log_path: Path
    ) -> None:
        self.metrics_path = output_dir / "metrics.jsonl"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "server.cli", "train", "--server", server.url,
            f"output_dir={output_dir}", *overrides,
        ]  # fmt: skip
        env = {**os.environ, "PROXRL_ADMIN_KEY": server.admin_key}
        with log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches it once, through stop()
                preexec_fn=die_with_parent(),  # SIGTERM (a clean stop) if the script is killed
            )

    def steps(self) -> list[dict[str, Any]]:
        """Every step logged so far (a line still being written is left out)."""
        if not self.metrics_path.exists():
            return []
        steps = []
        for line in self.metrics_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                steps.append(json.loads(line))
        return steps

    def exited(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        """Ctrl-C, once more if it has not stopped a minute later, then kill its process group."""
        for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGINT, 30), (signal.SIGKILL, 30)):
            if self.process.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)


def train(config: TrainConfig, stack: ExitStack) -> TrainerState:
    if not config.server:
        assert config.model is not None  # checked by the config
        server = LocalServer(config.model, Path(config.output_dir) / "server")
        stack.callback(server.stop)
        log.info("started proxrl serve at %s", server.url)
        # The dashboard's key, for the person at the terminal only: never into a log.
        print(f"proxrl serve at {server.url}; its admin key: {server.admin_key}", flush=True)
        config = dataclasses.replace(config, server=server.url, admin_key=server.admin_key)
    if not config.admin_key:
        raise SystemExit("proxrl train: no admin key (admin_key=, --admin-key or PROXRL_ADMIN_KEY)")
    api = ServerAPI(config.server, config.admin_key, config.request_timeout_s)
    stack.callback(api.close)
    trainer = Trainer(config, api)
    # engines elsewhere join the workers' weights group only when it publishes off loopback
    private_groups = config.publish.mode == "disk" or is_loopback(config.publish.master_address)
    stack.enter_context(
        LocalRay(config.cluster, config.world_size * config.cluster.cpus_per_worker, private_groups)
    )
    workers = WorkerGroup(
        config.world_size,
        worker_settings(config, trainer.model_dir, trainer.algorithm),
        config.cluster,
    )
    stack.callback(workers.shutdown)
    log.info(describe_start(config, trainer))
    install_signal_handlers(trainer)  # before start: a SIGTERM while it runs stops cleanly after
    trainer.start(workers)
    state = trainer.run()
    log.info("done: step %d, version %d", state.step, state.version)
    return state
