"""`proxrl train` as a real process against a live `proxrl serve`, as tests drive it: the server
seen through its REST API (sessions, episodes by the real openai SDK, rewards, statuses), a
trainer started, awaited, SIGKILLed, or stopped at a failpoint and killed there, and the figures
it wrote (metrics.jsonl). Knows nothing of what a test asserts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI

from tests.support import ROOT, ProxyProcess

__all__ = ["Server", "finish", "kill", "kill_at", "metrics", "start_trainer"]


@dataclass
class Server:
    """A live proxy through its REST API, with the admin key."""

    proxy: ProxyProcess
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.proxy.url, headers=self.proxy.admin, timeout=60)

    @property
    def run(self) -> dict:
        return next(r for r in self.http.get("/rl/runs").json() if r["is_default"])

    def configure(self, **config) -> None:
        reply = self.http.patch(f"/rl/runs/{self.run['id']}", json={"config": config})
        assert reply.status_code == 200, reply.text

    def session(self, **body) -> tuple[str, OpenAI]:
        created = self.proxy.session(**body)
        client = OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=5)
        return created["session_id"], client

    def reward(self, session_id: str, value: float, completion_id: str | None = None) -> dict:
        body = {"reward": value} | ({"completion_id": completion_id} if completion_id else {})
        reply = self.http.post(f"/rl/sessions/{session_id}/reward", json=body)
        assert reply.status_code in (200, 201), reply.text
        return reply.json()

    def end(self, session_id: str) -> None:
        assert self.http.post(f"/rl/sessions/{session_id}/end").status_code == 200

    def get(self, session_id: str) -> dict:
        return self.proxy.get_session(session_id)

    def statuses(self) -> dict[str, str]:
        listed = self.http.get("/rl/sessions", params={"limit": 1000}).json()
        return {s["session_id"]: s["status"] for s in listed}

    def episode(
        self,
        *,
        turns: int = 1,
        reward: float | None = 1.0,
        max_tokens: int = 6,
        end: bool = True,
        **sampling,
    ) -> str:
        """One session: ``turns`` chat turns continuing each other, a reward, the end."""
        session_id, client = self.session(task_id=sampling.pop("task_id", "t"))
        messages = [{"role": "user", "content": "Count."}]
        for _ in range(turns):
            reply = client.chat.completions.create(
                model=self.proxy_model, messages=messages, max_tokens=max_tokens, **sampling
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "More."},
            ]
        if reward is not None:
            self.reward(session_id, reward)
        if end:
            self.end(session_id)
        return session_id

    @property
    def proxy_model(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]


def start_trainer(server: Server, out: Path, *overrides: str, env: dict | None = None):
    out.mkdir(parents=True, exist_ok=True)
    log = (out / f"trainer-{time.monotonic_ns()}.log").open("w")
    command = [
        sys.executable, "-m", "server.cli", "train", "--server", server.proxy.url,
        "--admin-key", server.proxy.ADMIN_KEY, f"output_dir={out}", "lr=1e-3",
        "claim_wait_s=0.1", "cluster.cpus_per_worker=1", *overrides,
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environment,
        start_new_session=True,
    )  # fmt: skip
    process.log_path = Path(log.name)  # type: ignore[attr-defined]
    return process


def finish(process, timeout: float = 400) -> str:
    """Wait for the trainer to exit 0; its log."""
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    log = process.log_path.read_text()
    assert code == 0, log[-4000:]
    return log


def kill(process) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(60)


def kill_at(server: Server, out: Path, overrides: list[str], pause: str) -> None:
    """A trainer run until it stops at the failpoint ``pause`` (``point@step``, see
    trainer/failpoints.py), then SIGKILLed exactly there."""
    process = start_trainer(server, out, *overrides, env={"PROXRL_TRAINER_PAUSE_AT": pause})
    marker = out / "paused-at"
    deadline = time.monotonic() + 400
    while not marker.exists():
        assert process.poll() is None, process.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the trainer never reached {pause}"
        time.sleep(0.1)
    kill(process)
    marker.unlink()


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
