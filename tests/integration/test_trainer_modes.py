"""`proxrl train` beyond the defaults: two FSDP2 workers publishing over a torch.distributed
group (gloo) into the embedded engine, and the one-command local run that starts its own
server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from client_sdk import Client
from tests.support import ROOT, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def start_trainer(out: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "trainer.log"
    command = [
        sys.executable, "-m", "server.cli", "train", f"output_dir={out}", "lr=1e-3",
        "claim_wait_s=0.2", "cluster.cpus_per_worker=1", *args,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT
    )
    return process, log_path


def feed(url: str, admin_key: str, stop: threading.Event, errors: list[str]) -> None:
    """Rewarded single-turn sessions until ``stop`` (bounded)."""
    with Client(url, admin_key, timeout=120, max_retries=20) as client:
        for i in range(200):
            if stop.is_set():
                return
            try:
                with client.session(task_id=f"t{i % 2}") as session, session.openai() as model:
                    reply = model.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"{i}?"}], max_tokens=6
                    )
                    session.reward(float(len(reply.choices[0].message.content or "") % 2))
            except Exception as exc:
                if not stop.is_set():
                    errors.append(repr(exc))
                return


def finish(process: subprocess.Popen, log_path: Path, timeout: float) -> None:
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert code == 0, log_path.read_text()[-3000:]


def engine_logprob(engine_url: str, prompt_ids: list[int]) -> tuple[int, float]:
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
    }
    out = httpx.post(f"{engine_url}/generate", json=body, timeout=60).json()
    logprob, token, _ = out["meta_info"]["output_token_logprobs"][0]
    return token, logprob


def test_two_workers_publish_over_a_gloo_group(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "train"
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        stop, errors = threading.Event(), []
        agent = threading.Thread(target=feed, args=(proxy.url, proxy.ADMIN_KEY, stop, errors))
        agent.start()
        try:
            process, log_path = start_trainer(
                out,
                "--server", proxy.url, "--admin-key", proxy.ADMIN_KEY,
                "world_size=2", "publish.mode=distributed", "max_steps=2", "batch_size=4",
                "checkpoint_every=1",
            )  # fmt: skip
            finish(process, log_path, 600)
        finally:
            stop.set()
            agent.join(120)
        assert not errors, errors[:3]
        log = log_path.read_text()
        assert re.search(r"weight group proxrl_weights-[0-9a-f]{8} formed with 1 engine\(s\)", log)
        assert not (out / "weights").exists()  # nothing went through the disk
        [engine] = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin).json()
        assert engine["weight_version"] == "2"
        run = next(r for r in httpx.get(f"{proxy.url}/rl/runs", headers=proxy.admin).json())
        assert run["policy_version"] == 2 and run["weights_path"] is None

        # The engine serves exactly the weights the trainer checkpointed after step 2.
        state = torch.load(out / "checkpoints" / "step-000002" / "train_state.pt")
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state["model"])
        assert max((model.state_dict()[k] - base[k]).abs().max().item() for k in base) > 1e-4
        prompt = [5, 17, 40, 41, 300, 12]
        token, served = engine_logprob(engine["url"], prompt)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert int(logits.argmax()) == token
        assert torch.log_softmax(logits, -1)[token].item() == pytest.approx(served, abs=1e-4)


def test_one_command_local_run_starts_and_stops_its_own_server(tiny_model_dir, tmp_path):
    out = tmp_path / "local"
    process, log_path = start_trainer(
        out, "--model", str(tiny_model_dir), "max_steps=1", "batch_size=2"
    )
    deadline = time.monotonic() + 240
    found = None
    while found is None:
        assert process.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the local server never started"
        found = re.search(r"proxrl serve at (\S+); its admin key: (\S+)", log_path.read_text())
        time.sleep(0.3)
    url, admin_key = found.group(1), found.group(2)
    stop, errors = threading.Event(), []
    agent = threading.Thread(target=feed, args=(url, admin_key, stop, errors))
    agent.start()
    try:
        finish(process, log_path, 400)
    finally:
        stop.set()
        agent.join(120)
    assert "done: step 1, version 1" in log_path.read_text()
    with pytest.raises(httpx.TransportError):  # the server went with the trainer
        httpx.get(f"{url}/health", timeout=2)
    assert (out / "weights" / "v000001" / "model.safetensors").exists()
