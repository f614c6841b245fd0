"""``proxrl serve`` on a fresh store in front of an engine that serves other weights (a version a
deployment whose store is gone swapped in): the store is the truth, and a run that has published
nothing serves the base model, so the engine is reset to it as version 0 and serves; an engine
that cannot load the base model stays out of rotation, and ``/admin/engines`` says why."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support import EngineProcess, ProxyProcess, teacher_forced_logprobs

LOGPROB_TOLERANCE = 1e-4
HEALTH_INTERVAL_S = 0.5
SETTLE_S = 20.0  # for the proxy's first health rounds


class ServingProxy(ProxyProcess):
    """Ready once it answers at all: ``/health`` is what the tests judge."""

    ready_path = "/"


@pytest.fixture(scope="module")
def v7_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """Weights of a version 7 the new store has no record of: the tiny model, perturbed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    folder = tmp_path_factory.mktemp("old-deployment") / "v7"
    model.save_pretrained(folder)
    return folder


def engine_at_v7(tiny_model_dir: Path, v7_dir: Path, logs: Path) -> EngineProcess:
    """A running engine swapped to version 7 by a proxrl deployment whose store is gone."""
    engine = EngineProcess(tiny_model_dir, logs, "--num-threads", "1").wait_ready()
    try:
        swap = httpx.post(
            f"{engine.url}/update_weights_from_disk",
            json={"model_path": str(v7_dir), "weight_version": "7"},
            timeout=120,
        )
        assert swap.status_code == 200 and swap.json()["success"], swap.text
        info = httpx.get(f"{engine.url}/model_info", timeout=10).json()
        # The engine's own model path is the folder it loaded last, not its base model.
        assert (info["weight_version"], info["model_path"]) == ("7", str(v7_dir))
    except BaseException:
        engine.stop()
        raise
    return engine


def engines_once(proxy: ProxyProcess, settled, timeout: float = SETTLE_S) -> list[dict]:
    """``/admin/engines`` once ``settled(engines)`` holds, after two more health rounds."""
    deadline = time.monotonic() + timeout
    while True:
        engines = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin, timeout=10).json()
        if settled(engines):
            break
        assert time.monotonic() < deadline, engines
        time.sleep(0.1)
    time.sleep(2 * HEALTH_INTERVAL_S)
    return httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin, timeout=10).json()


def test_an_engine_at_an_unrecorded_version_is_reset_to_the_base_model(
    tiny_model_dir: Path, v7_dir: Path, tmp_path: Path
):
    flags = ("--health-interval-s", str(HEALTH_INTERVAL_S))
    with engine_at_v7(tiny_model_dir, v7_dir, tmp_path) as engine:
        with ServingProxy(tiny_model_dir, tmp_path / "fresh", "--engines", engine.url, *flags) as p:
            (state,) = engines_once(p, lambda engines: engines[0]["weight_version"] == "0")
            assert state["healthy"], state
            assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200
            info = httpx.get(f"{engine.url}/model_info", timeout=10).json()
            assert (info["weight_version"], info["model_path"]) == ("0", str(tiny_model_dir))

            session = p.session(task_id="fresh-store")
            reply = httpx.post(
                f"{session['base_url']}/chat/completions",
                headers={"Authorization": f"Bearer {session['api_key']}"},
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Count with me."}],
                    "max_tokens": 12,
                },
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            (turn,) = p.get_session(session["session_id"])["turns"]
            assert turn["versions"] == [0] * len(turn["completion_ids"]) != []
            # The tokens are the base model's, not version 7's under the name 0.
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
            expected = teacher_forced_logprobs(base, turn["prompt_ids"], turn["completion_ids"], 1)
            error = max(abs(a - b) for a, b in zip(turn["logprobs"], expected, strict=True))
            assert error < LOGPROB_TOLERANCE
        log = p.log_path.read_text()
        assert f"engine {engine.url} served version 7" in log
        assert f"reset it to the base model {tiny_model_dir}" in log


def test_an_engine_that_cannot_load_the_base_model_stays_out_and_says_why(
    tiny_model_dir: Path, v7_dir: Path, tmp_path: Path
):
    # A proxy whose --model holds the tokenizer only (its engines run elsewhere): the engine
    # cannot load base weights from it.
    tokenizer_only = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_model_dir, tokenizer_only, ignore=shutil.ignore_patterns("*.safetensors"))
    flags = ("--health-interval-s", str(HEALTH_INTERVAL_S))
    with engine_at_v7(tiny_model_dir, v7_dir, tmp_path) as engine:
        with ServingProxy(tokenizer_only, tmp_path / "fresh", "--engines", engine.url, *flags) as p:
            (state,) = engines_once(p, lambda engines: not engines[0]["healthy"])
            assert not state["healthy"] and state["weight_version"] == "7", state
            # Still said after health rounds judged it off-version again.
            reason = state["last_error"]
            assert reason.startswith("serves version 7, not 0: weights no run"), reason
            assert f"resetting it to the base model {tokenizer_only} failed" in reason
            assert "restart the engine on its base model, or publish weights" in reason
            health = httpx.get(f"{p.url}/health", timeout=10)
            assert health.status_code == 503, health.text
        info = httpx.get(f"{engine.url}/model_info", timeout=10).json()
        assert info["weight_version"] == "7"
        log = p.log_path.read_text()
        assert f"engine {engine.url} out of rotation: serves version 7, not 0: weights" in log


def test_engines_at_another_runs_recorded_version_keep_it_when_serve_restarts(
    tiny_model_dir: Path, v7_dir: Path, tmp_path: Path
):
    """Run B's swap to version 7 was the last (the default run has published nothing): a
    restarted ``proxrl serve`` on the same SQLite store keeps the engine at 7, in rotation, as a
    replica taking the lead over Postgres does. Before, it expected the default run's 0 and took
    the engine out of rotation for good."""
    flags = ("--health-interval-s", str(HEALTH_INTERVAL_S))
    data = tmp_path / "data"
    with EngineProcess(tiny_model_dir, tmp_path, "--num-threads", "1").wait_ready() as engine:
        with ServingProxy(tiny_model_dir, data, "--engines", engine.url, *flags) as first:
            created = httpx.post(
                f"{first.url}/rl/runs", headers=first.admin, json={"name": "b"}, timeout=10
            )
            assert created.status_code == 201, created.text
            body = {"run_id": created.json()["id"], "model_path": str(v7_dir), "version": 7}
            swap = httpx.post(
                f"{first.url}/admin/weights", headers=first.admin, json=body, timeout=120
            )
            assert swap.status_code == 200, swap.text
        with ServingProxy(tiny_model_dir, data, "--engines", engine.url, *flags) as again:
            (state,) = engines_once(again, lambda engines: engines[0]["weight_version"] == "7")
            assert state["healthy"] and not state["last_error"], state
            assert httpx.get(f"{again.url}/health", timeout=10).status_code == 200


def test_a_sqlite_server_resumes_engines_a_killed_one_left_paused(
    tiny_model_dir: Path, tmp_path: Path
):
    """A SQLite ``proxrl serve`` killed mid-swap leaves its engines paused (a paused engine holds
    every request). The one server leads from the start with no takeover, and it never resumed
    them: every request was held until the next swap. It now resumes them as it starts."""
    flags = ("--health-interval-s", str(HEALTH_INTERVAL_S))
    with EngineProcess(tiny_model_dir, tmp_path, "--num-threads", "1").wait_ready() as engine:
        paused = httpx.post(f"{engine.url}/pause_generation", json={"mode": "abort"}, timeout=10)
        assert paused.status_code == 200, paused.text
        with ServingProxy(tiny_model_dir, tmp_path / "data", "--engines", engine.url, *flags) as p:
            session = p.session(task_id="paused-engines")
            reply = httpx.post(
                f"{session['base_url']}/chat/completions",
                headers={"Authorization": f"Bearer {session['api_key']}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "Hi."}]}
                | {"max_tokens": 4},
                timeout=30,  # a paused engine holds it for good
            )
            assert reply.status_code == 200, reply.text
