"""The whole loop on the tiny model: a real proxy + engine, an agent, and `proxrl train`.

An agent thread keeps opening sessions through the real openai SDK and rewarding them; the
trainer (a real `proxrl train` process with Ray and FSDP2 workers) claims, trains, publishes
into the engine while it serves, and checkpoints. Then the trainer is killed mid-run and
restarted: it must resume at the right version without training any session twice or
skipping one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from client_sdk import Client
from tests.support import ROOT, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BATCH = 4


class Agent(threading.Thread):
    """Sessions of one or two turns, rewarded by a rule of the answer, until stopped."""

    def __init__(self, url: str, admin_key: str, limit: int) -> None:
        super().__init__(daemon=True)
        self.url, self.admin_key, self.limit = url, admin_key, limit
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []

    def run(self) -> None:
        with Client(self.url, self.admin_key, timeout=120, max_retries=20) as client:
            while not self.stop.is_set():
                if self.done >= self.limit:  # the test raises the limit to let it go on
                    time.sleep(0.1)
                    continue
                try:
                    self.one(client, self.done)
                except Exception as exc:
                    self.errors.append(repr(exc))
                    time.sleep(0.5)
                self.done += 1

    def one(self, client: Client, i: int) -> None:
        with (
            client.session(task_id=f"t{i % 3}") as session,
            session.openai(max_retries=10) as model,
        ):
            messages = [{"role": "user", "content": f"Count to {i % 7}."}]
            for _ in range(1 + i % 2):
                reply = model.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=12, temperature=1.0
                )
                text = reply.choices[0].message.content or ""
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "More."},
                ]
            session.reward(1.0 if len(text) % 2 == 0 else 0.0)


def train(proxy: ProxyProcess, out: Path, *overrides: str) -> subprocess.Popen:
    """``proxrl train`` on the proxy. The agent starts before the trainer sets the run's
    admission bound, so its first sessions are all sampled by version 0: max_staleness 4 lets
    every step train them (this test is about resuming, not about staleness)."""
    command = [
        sys.executable, "-m", "server.cli", "train", "--server", proxy.url,
        "--admin-key", proxy.ADMIN_KEY, f"output_dir={out}", f"batch_size={BATCH}",
        "max_staleness=4", "lr=1e-3", "claim_wait_s=0.2", "cluster.cpus_per_worker=1",
        *overrides,
    ]  # fmt: skip
    log = (out.parent / f"{out.name}-{time.monotonic_ns()}.log").open("w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sessions_by_status(proxy: ProxyProcess) -> dict[str, int]:
    run = next(
        r for r in httpx.get(f"{proxy.url}/rl/runs", headers=proxy.admin).json() if r["is_default"]
    )
    return run["sessions"]


def run_state(proxy: ProxyProcess) -> dict:
    runs = httpx.get(f"{proxy.url}/rl/runs", headers=proxy.admin).json()
    return next(r for r in runs if r["is_default"])


def dashboard_trainer(proxy: ProxyProcess) -> str:
    """What the dashboard says of the default run's trainer."""
    path = f"{proxy.url}/admin/api/runs/{run_state(proxy)['id']}"
    return httpx.get(path, headers=proxy.admin).json()["trainer"]


@pytest.fixture
def proxy(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as running:
        yield running


def test_the_trainer_learns_publishes_and_resumes_exactly(  # noqa: PLR0915  # one scenario
    proxy, tiny_model_dir, tmp_path
):
    out = tmp_path / "train"
    agent = Agent(proxy.url, proxy.ADMIN_KEY, limit=3 * BATCH)  # enough for 3 steps, then none
    agent.start()
    # One session stays open across a weight swap: its second turn is served by a new version.
    straddler = proxy.session(task_id="straddle")
    straddle = OpenAI(base_url=straddler["base_url"], api_key=straddler["api_key"])
    first = straddle.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    try:
        # Run 1 checkpoints at step 2, trains step 3, and is killed while it waits for the
        # sessions of step 4: step 3's claim is trained and published but not confirmed.
        trainer = train(proxy, out, "max_steps=6", "checkpoint_every=2")
        deadline = time.monotonic() + 400
        while len(metrics(out)) < 3:
            assert trainer.poll() is None, "the trainer exited early"
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.2)
        time.sleep(1.0)  # it is now polling for trainable sessions that will not come
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        assert len(metrics(out)) == 3
        killed = metrics(out)[:3]
        assert [m["version"] for m in killed] == [1, 2, 3]
        assert run_state(proxy)["policy_version"] == 3
        assert dashboard_trainer(proxy) == "training"  # killed: no word, the timeout applies

        second = straddle.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "Again"},
            ],
            max_tokens=8,
        )
        assert second.choices[0].message is not None

        # Run 2: resumes from step 2 (version 2), republishes as version 4, trains steps 3-6.
        agent.limit = 100
        trainer = train(proxy, out, "max_steps=6", "checkpoint_every=2")
        assert wait(trainer, 600) == 0
        assert dashboard_trainer(proxy) == "stopped"  # a clean stop says so at once
    finally:
        agent.stop.set()
        agent.join(120)
    steps = metrics(out)
    resumed = steps[3:]
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    assert [m["version"] for m in resumed] == [5, 6, 7, 8]  # 4 was the republished checkpoint
    assert run_state(proxy)["policy_version"] == 8
    engines = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin).json()
    assert [e["weight_version"] for e in engines] == ["8"]

    # Exactly once: the surviving lineage (steps 1-2 of run 1, steps 3-6 of run 2) trained
    # each session once, and those are exactly the sessions the store marks consumed.
    lineage = [s for m in killed[:2] + resumed for s in m["session_ids"]]
    assert len(lineage) == len(set(lineage)) == 6 * BATCH
    consumed = {
        s["session_id"]
        for s in httpx.get(
            f"{proxy.url}/rl/sessions",
            params={"status": "consumed", "limit": 1000},
            headers=proxy.admin,
        ).json()
    }
    assert consumed == set(lineage)
    # The killed step's sessions went back to the pool and were trained in the new lineage.
    assert set(killed[2]["session_ids"]) <= set(lineage)
    assert (out / "claims.jsonl").read_text() == ""

    # TensorBoard holds every step of that lineage once: the killed run's step 3 is replaced
    # by the resumed one's (trainer/tracking.py; TensorBoard keeps float32).
    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("reward/mean")] == [
        (m["step"], float(np.float32(m["reward_mean"]))) for m in killed[:2] + resumed
    ]

    # The weights moved, and the published directory is what the engine serves.
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    final = load_file(out / "weights" / "v000008" / "model.safetensors")
    assert max((final[k] - base[k]).abs().max().item() for k in base) > 1e-4

    # A session that straddled a swap carries tokens of two versions in its row.
    stored = proxy.get_session(straddler["session_id"])
    versions = {v for turn in stored["turns"] for v in turn["versions"]}
    assert len(versions) == 2, versions
    assert len(stored["rows"]) == 1
    assert not agent.errors, agent.errors[:3]
