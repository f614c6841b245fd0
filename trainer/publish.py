"""Getting a new policy version into the engines while they serve.

``disk``: the workers write the weights as a Hugging Face directory (safetensors) and the
server swaps them in (``POST /admin/weights``: pause, load, continue). ``distributed``: the
trainer's rank 0 joins a torch.distributed group with every engine (through the server's
``POST /admin/weights/group``) and broadcasts the weights into them while the server holds the
engines paused (``POST /admin/weights`` with ``distributed``). A LoRA run publishes on disk only:
the workers write the adapter (peft's ``save_pretrained`` layout) and the server has the engines
load it under a name of its own (``POST /admin/weights`` with ``adapter_path``), no pause. Either
way the server bumps the run's ``policy_version``; this module knows nothing about training.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainer.cluster import WorkerGroup
from trainer.config import TrainConfig
from trainer.server_api import ServerAPI

log = logging.getLogger(__name__)

# A group per trainer process: engines keep a group until told to leave it, and a trainer that
# died never told them, so its successor's group needs a name of its own.
GROUP_PREFIX = "proxrl_weights-"


class Publisher:
    def __init__(
        self,
        config: TrainConfig,
        server: ServerAPI,
        run_id: str,
        workers: WorkerGroup,
        output_dir: Path,
    ) -> None:
        self.config = config.publish
        self.adapter = config.lora is not None  # the versions are adapters, not full weights
        self.server = server
        self.run_id = run_id
        self.workers = workers
        self.weights_dir = output_dir / "weights"  # absolute: resolved once, on the driver
        self.metadata: dict | None = None
        self.group_name = GROUP_PREFIX + secrets.token_hex(4)

    def publish(self, version: int) -> float:
        """Serve the workers' current weights as ``version``; returns the seconds it took."""
        started = time.perf_counter()
        if self.config.mode == "disk":
            self._publish_disk(version)
        else:
            self._publish_distributed(version)
        return time.perf_counter() - started

    def _publish_disk(self, version: int) -> None:
        path = self.weights_dir / f"v{version:06d}"
        self.workers.call("save_weights", str(path))
        self.server.publish(
            self.run_id, str(path), version, self.config.timeout_s, adapter=self.adapter
        )
        versions = sorted(self.weights_dir.glob("v*"))
        for old in versions[: -self.config.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)

    def check_readable(self) -> None:
        """``disk``: the server and every engine must read what rank 0 writes under
        ``output_dir/weights/``; raise :class:`WeightsUnreadable`, saying what is needed,
        when one cannot. Engines that cannot be asked (SGLang) are logged as unchecked, and
        engines that did not answer (down, or slow) as unknown: a warning, not a stop."""
        if self.config.mode != "disk":
            return
        token = secrets.token_hex(16)
        path = self.workers.call("write_probe", str(self.weights_dir), token)[0]
        try:
            answer = self.server.probe_weights(path, token)
        finally:
            Path(path).unlink(missing_ok=True)  # where the driver shares rank 0's disk
        readers = [answer["server"], *answer["engines"]]
        unchecked = [r["url"] for r in readers if not r["checked"]]
        if unchecked:
            log.warning(
                "publish.mode=disk: could not check that %s read %s (no probe route); they "
                "must see that path", ", ".join(unchecked), self.weights_dir,
            )  # fmt: skip
        silent = [r for r in readers if r["checked"] and not r.get("answered", True)]
        for reader in silent:
            log.warning(
                "publish.mode=disk: could not check that %s reads %s (%s); it must see that "
                "path, or its first publish fails", reader["url"], self.weights_dir,
                reader["problem"],
            )  # fmt: skip
        failed = [
            r for r in readers if r["checked"] and r.get("answered", True) and not r["readable"]
        ]
        if failed:
            raise WeightsUnreadable(unreadable_message(path, failed))
        read = sum(r["readable"] for r in answer["engines"])
        log.info("publish.mode=disk: the server and %d engine(s) read %s", read, path)

    def _publish_distributed(self, version: int) -> None:
        if self.metadata is None:
            self._form_group()
        assert self.metadata is not None
        sending = self.workers.start("broadcast_weights")
        self.server.publish_distributed(
            self.run_id, version, self.metadata, self.group_name, self.config.timeout_s
        )
        self.workers.wait(sending, timeout=self.config.timeout_s)

    def _form_group(self) -> None:
        """Rank 0 and every engine form one group; the server tells the engines to join."""
        engines = [e for e in self.server.engines() if e["healthy"]]
        if not engines:
            raise RuntimeError("no healthy engine to form a weight group with")
        # rank 0 hosts the group: on a cluster, on a node other than this driver's
        address = self.config.master_address or self.workers.rank0_address
        port = self.workers.wait([self.workers.workers[0].free_port.remote(address)])[0]
        joining = self.workers.start(
            "join_weight_group", address, port, group_world_size(engines), self.group_name
        )
        backend = "nccl" if self.workers.info.get("device", "cpu").startswith("cuda") else "gloo"
        with ThreadPoolExecutor(1) as pool:  # the rendezvous needs both sides at once
            asking = pool.submit(
                self.server.init_weight_group, address, port, self.group_name, backend
            )
            deadline = time.monotonic() + self.config.timeout_s
            while True:  # rank 0 waits for engines the server may have failed to send
                try:
                    self.workers.wait(joining, timeout=1.0)
                    break
                except TimeoutError:
                    if asking.done():
                        asking.result()  # the server's refusal, at once
                    if time.monotonic() > deadline:
                        raise
            result = asking.result(timeout=self.config.timeout_s)
        self.metadata = self.workers.call("weight_metadata")[0]
        log.info(
            "weight group %s formed with %d engine(s): %s", self.group_name, len(engines), result
        )


class WeightsUnreadable(RuntimeError):
    """With ``publish.mode=disk``, the server or an engine cannot read the trainer's files."""


def unreadable_message(path: str, failed: list[dict]) -> str:
    who = "; ".join(f"{r['url'] or 'the server'}: {r['problem']}" for r in failed)
    return (
        f"publish.mode=disk needs the server and every engine to read what the trainer writes "
        f"under {Path(path).parent}, and the probe {path} was not read by {who}. Give them that "
        "directory at the same path (a shared filesystem when they run on other machines), or "
        "set publish.mode=distributed (the engines receive the weights over the network)"
    )


def group_world_size(engines: list[dict]) -> int:
    """Rank 0 and every tensor-parallel rank of every engine (``GET /admin/engines`` rows; the
    server numbers the engines' ranks the same way in server/rl/weights.py)."""
    return 1 + sum(engine.get("tp_size") or 1 for engine in engines)
