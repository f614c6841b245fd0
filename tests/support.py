"""Helpers for tests that run real processes: free ports, an engine process, teacher forcing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """``proxrl engine`` as a real process on loopback, stopped on exit."""

    def __init__(self, model_dir: Path, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{self.port}.log"
        command = [
            sys.executable, "-m", "server.cli", "engine",
            "--model", str(model_dir), "--port", str(self.port), "--log-level", "warning",
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 120.0) -> EngineProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited early:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/model_info", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not ready in {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def teacher_forced_logprobs(
    model, prompt_ids: list[int], output_ids: list[int], temperature: float
) -> list[float]:
    """log p(output token | everything before it) under ``model``, at ``temperature``."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    t = 1.0 if temperature < 1e-6 else temperature
    log_probs = torch.log_softmax(logits / t, dim=-1)
    return log_probs.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1).tolist()


def parse_sse(body: str) -> list[dict | str]:
    """The events of an SSE body: parsed JSON, or the string ``[DONE]``."""
    import json

    events: list[dict | str] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream_events(client: httpx.AsyncClient, url: str, body: dict, on_chunk=None) -> list:
    """POST a streaming /generate and collect its events; ``on_chunk(chunk)`` sees each one."""
    import json

    events: list = []
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            event = payload if payload == "[DONE]" else json.loads(payload)
            events.append(event)
            if on_chunk is not None and event != "[DONE]":
                on_chunk(event)
    return events
