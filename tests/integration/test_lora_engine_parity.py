"""The embedded engine and SGLang (its double) answer the engine client's LoRA calls in the same
shapes: the same client calls, once straight to a real embedded engine and once through the
SGLang double in front of it, give the same statuses, the same answer fields and the same
adapters loaded; a request served with an adapter gives the same tokens and logprobs both ways,
and differs from the base model's.

Where the two differ by design, this file says so and does not compare: past the bound SGLang
evicts its least recently used adapter while the embedded engine refuses the load; SGLang reloads
a name that was unloaded when a request names it (docs/architecture/sglang-protocol.md, "LoRA
adapters"); refusal messages are each engine's own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from server.engine_client.client import EngineClient
from server.errors import EngineRejected
from tests.sglang_double import DoubleProcess
from tests.support import EngineProcess

RANK = 4
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> str:
    """An adapter of the tiny model in peft's save_pretrained format (the shared contract),
    written with safetensors (peft is not installed here), with A and B both random: an adapter
    that changes nothing would not show which weights served a request."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors = {}
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            out_features, in_features = module.weight.shape
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, in_features) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, RANK) * 0.5
    assert tensors, "the tiny model has no target module"
    directory = tmp_path_factory.mktemp("adapter")
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 8,
        "target_modules": TARGETS,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    """A real embedded engine, and the double (SGLang with LoRA) in front of the same engine:
    each script below leaves the engine as it found it, so one runs after the other."""
    logs = tmp_path_factory.mktemp("lora-parity-logs")
    flags = ("--num-threads", "1", "--max-loaded-loras", "3")
    with EngineProcess(tiny_model_dir, logs, *flags) as engine:
        lora = ("--enable-lora", "--max-lora-rank", str(RANK), "--lora-target-modules", *TARGETS)
        bound = ("--max-loaded-loras", "2", "--max-loras-per-batch", "2")
        double = DoubleProcess(engine.url, logs / "double.log", *lora).wait_ready()
        bounded = DoubleProcess(engine.url, logs / "bounded.log", *lora, *bound).wait_ready()
        try:
            yield {"embedded": engine.url, "sglang": double.url, "bounded": bounded.url}
        finally:
            double.stop()
            bounded.stop()


Call = Callable[[EngineClient], Awaitable[Any]]


def transcript(url: str, calls: list[Call]) -> list[tuple[str, Any]]:
    """("ok", answer) or ("refused", engine status) of each call, in order, on the engine at
    ``url``."""

    async def scenario() -> list[tuple[str, Any]]:
        outcomes: list[tuple[str, Any]] = []
        async with aiohttp.ClientSession() as http:
            client = EngineClient(url, http, generate_timeout=60)
            for call in calls:
                try:
                    outcomes.append(("ok", await call(client)))
                except EngineRejected as exc:
                    outcomes.append(("refused", exc.engine_status))
        return outcomes

    return asyncio.run(scenario())


def generate(lora_path: Any) -> Call:
    body: dict[str, Any] = {
        "input_ids": [1, 5, 9, 14],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path

    async def call(client: EngineClient) -> tuple[list[int], list[float]]:
        piece = await client.generate(body)
        return piece.ids, piece.logprobs

    return call


def adapter_fields(answer: dict) -> tuple:
    """What the engine client reads of an adapter answer (SGLang adds rid and the like)."""
    return answer["success"], answer["error_message"], answer["loaded_adapters"]


def test_the_same_calls_answer_in_the_same_shapes(engines, adapter, tmp_path):
    missing = str(Path(tmp_path) / "no-such-adapter")
    calls: list[Call] = [
        lambda client: client.load_lora_adapter("run@1", adapter),
        lambda client: client.load_lora_adapter("run@1", adapter),  # a name is loaded once
        lambda client: client.load_lora_adapter("ghost@1", missing),
        lambda client: client.unload_lora_adapter("run@2"),
        generate("nobody"),
        generate("run@1"),
        generate(None),
        lambda client: client.unload_lora_adapter("run@1"),
    ]
    embedded = transcript(engines["embedded"], calls)
    sglang = transcript(engines["sglang"], calls)

    for outcomes in (embedded, sglang):
        assert [kind for kind, _ in outcomes] == ["ok"] + ["refused"] * 4 + ["ok"] * 3
        assert [status for kind, status in outcomes if kind == "refused"] == [400] * 4
        assert adapter_fields(outcomes[0][1]) == (True, "", {"run@1": adapter})
        assert adapter_fields(outcomes[7][1]) == (True, "", {})
    served, base = embedded[5][1], embedded[6][1]
    assert (sglang[5][1], sglang[6][1]) == (served, base)
    assert len(served[0]) == 6 and served != base  # the adapter changed what was sampled


def test_past_its_bound_sglang_evicts_and_reloads_where_the_embedded_engine_refuses(
    engines, adapter
):
    """The difference by design, on the real engine: the embedded engine refuses a load past
    --max-loaded-loras; SGLang (the double, bound 2, in front of it) unloads its least recently
    used adapter from the engine, and a request for that adapter loads it again and is served
    as before."""
    names = ["a@1", "b@1", "c@1", "d@1"]
    loads = [lambda client, n=name: client.load_lora_adapter(n, adapter) for name in names]
    embedded = transcript(engines["embedded"], loads)
    assert [kind for kind, _ in embedded] == ["ok", "ok", "ok", "refused"]  # its bound: 3
    cleanup = [lambda client, n=name: client.unload_lora_adapter(n) for name in names[:3]]
    assert [kind for kind, _ in transcript(engines["embedded"], cleanup)] == ["ok"] * 3

    sglang = transcript(
        engines["bounded"],
        [*loads[:3], generate("a@1"), lambda client: client.models(), generate("a@1")],
    )
    assert [kind for kind, _ in sglang] == ["ok"] * 6
    assert set(sglang[2][1]["loaded_adapters"]) == {"b@1", "c@1"}  # a@1 was evicted
    cards = [card["id"] for card in sglang[4][1]["data"][1:]]
    assert cards == ["c@1", "a@1"]  # a@1 reloaded for the request, b@1 evicted for it
    assert sglang[3][1] == sglang[5][1]
    engine_holds = transcript(engines["embedded"], [lambda client: client.models()])[0][1]
    assert sorted(card["id"] for card in engine_holds["data"][1:]) == ["a@1", "c@1"]
