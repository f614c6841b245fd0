"""The embedded engine on CUDA (skipped on machines without it): same protocol, same exactness."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.engine.runner import ModelRunner, RunnerConfig
from tests.support import EngineProcess, logprob_error

pytestmark = pytest.mark.gpu


def test_fast_decode_on_cuda_matches_cpu(tiny_model_dir):
    cpu = ModelRunner(RunnerConfig(str(tiny_model_dir), max_slots=2))
    gpu = ModelRunner(RunnerConfig(str(tiny_model_dir), device="cuda", max_slots=2))
    ids = list(range(20, 60))
    for runner in (cpu, gpu):
        runner.prefill(0, ids[:-1])
    a = cpu.decode([ids[-1]], [len(ids) - 1])
    b = gpu.decode([ids[-1]], [len(ids) - 1]).cpu()
    assert (a - b).abs().max() < 1e-4


def test_engine_serves_exact_logprobs_on_cuda(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    flags = ("--device", "cuda", "--dtype", "float32")
    with EngineProcess(tiny_model_dir, tmp_path, *flags) as engine:
        assert httpx.get(f"{engine.url}/v1/loads").json()["accelerator"] == "cuda"
        out = httpx.post(
            f"{engine.url}/generate",
            json={
                "input_ids": [3, 4, 5],
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
                "return_logprob": True,
            },
            timeout=60,
        ).json()
    assert logprob_error(model, [3, 4, 5], out) < 1e-4
    assert torch.cuda.is_available()
