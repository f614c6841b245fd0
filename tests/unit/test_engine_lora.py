"""LoRA adapters on the embedded engine: exact per row, held within a bound, never mixed up.

* Exactness: four adapters (random A and non-zero random B, different ranks, alphas, targets,
  one rsLoRA, the output layer too on llama) and one base row run together through the real
  EngineService; every prompt logprob (prefill) and every sampled token's logprob (decode) of
  each row equals a float64 teacher-forced forward of the base model with that row's adapter
  merged by hand from the definition (Hu et al. 2021, eq. 3: W = W0 + (alpha/r) B A) within
  ``TOLERANCE``; the base row equals the base model. On the fast decode path (llama, qwen2,
  qwen3) and the Hugging Face path (gemma2, gpt_neox).
* The bank: load, unload, the bound, broken directories and duplicate names, and (hypothesis)
  any sequence of loads, unloads and requests against a plain model of what should be held.
* The prefix cache: the same prompt under two adapters never shares KV.
* HTTP: SGLang's shapes for /load_lora_adapter, /unload_lora_adapter, ``lora_path`` and
  /v1/models; bad input is a 400; the admin key guards the two routes.

Adapters are written in peft's ``save_pretrained`` format by hand (``write_adapter``): the
format is the contract between trainer and engine (adapter_config.json, and
``base_model.model.<module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from server.engine import protocol
from server.engine.app import create_app
from server.engine.lora import Adapter, AdapterBank, AdapterError
from server.engine.runner import ModelRunner, RunnerConfig
from server.engine.service import EngineService
from server.engine.settings import EngineSettings

TOLERANCE = 1e-4  # nats, float32 against float64 (as tests/unit/test_architectures_engine.py)
B_SCALE = 0.3  # B's entries: large enough that an adapter moves logprobs by far more than 1e-4

ATTENTION = {
    "gpt_neox": ["query_key_value", "dense"],
}
MLP = {
    "gpt_neox": ["dense_h_to_4h", "dense_4h_to_h"],
}
DEFAULT_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEFAULT_MLP = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(
    directory: Path,
    model_dir: str,
    targets: list[str],
    rank: int,
    alpha: float,
    seed: int,
    rslora: bool = False,
    **config_extra,
) -> Path:
    """A random adapter for ``targets`` of the model in ``model_dir``, saved as peft does."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=generator) / math.sqrt(rank)
            b = torch.randn(module.out_features, rank, generator=generator) * B_SCALE
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "lora_dropout": 0.05,
        "use_rslora": rslora,
        "bias": "none",
        "modules_to_save": None,
        "use_dora": False,
        "task_type": "CAUSAL_LM",
        **config_extra,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


def merged_logprobs(model_dir: str, adapter_dir: Path | None, ids: list[int]) -> torch.Tensor:
    """Float64 teacher-forced logprobs of ``ids`` under W0 + scale * B @ A, merged by hand from
    the adapter's files (nothing of the engine's)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    if adapter_dir is not None:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        rank = config["r"]
        scale = config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)
        tensors = load_file(adapter_dir / "adapter_model.safetensors")
        modules = dict(model.named_modules())
        with torch.no_grad():
            for key, a in tensors.items():
                if ".lora_A." not in key:
                    continue
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                modules[name].weight += scale * b.double() @ a.double()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    target = torch.tensor(ids[1:])
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, target[:, None])[:, 0]


def four_adapters(root: Path, name: str, model_dir: str) -> dict[str, Path]:
    attention = ATTENTION.get(name, DEFAULT_ATTENTION)
    mlp = MLP.get(name, DEFAULT_MLP)
    output = ["lm_head"] if name == "llama" else []  # untied: the reference can merge into it
    specs: dict[str, dict[str, Any]] = {
        "a@1": dict(targets=attention + mlp, rank=4, alpha=8, seed=1),
        "b@1": dict(targets=attention[:2], rank=2, alpha=16, seed=2),
        "c@1": dict(targets=mlp, rank=8, alpha=8, seed=3, rslora=True),
        "d@1": dict(targets=[attention[-1], mlp[-1], *output], rank=1, alpha=1.5, seed=4),
    }
    return {
        adapter: write_adapter(root / name / adapter.replace("@", "_"), model_dir, **spec)
        for adapter, spec in specs.items()
    }


def settings_for(model_dir: str, **extra) -> EngineSettings:
    return EngineSettings(model=model_dir, device="cpu", dtype="float32", **extra)


async def _generate(service: EngineService, ids: list[int], lora: str | None, new: int) -> dict:
    request = protocol.GenerateRequestIn(
        input_ids=ids,
        sampling_params={"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        lora_path=lora,
    )
    items, _ = service.parse(request)
    return (await service.generate(request, items))[0]


def _logprobs(output: dict, key: str) -> tuple[list[int], torch.Tensor]:
    entries = [e for e in output["meta_info"][key] if e[0] is not None]
    return [e[1] for e in entries], torch.tensor([e[0] for e in entries], dtype=torch.float64)


# ----- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "gpt_neox"])
def test_rows_of_four_adapters_and_the_base_in_one_batch_are_exact(name, model_dirs, tmp_path):
    model_dir = model_dirs[name]
    adapters = four_adapters(tmp_path, name, model_dir)
    service = EngineService(settings_for(model_dir, seed=3))
    assert (service.runner.fast is not None) == (name in ("llama", "qwen2", "qwen3"))
    batches: list[set] = []
    decode = service.runner.decode

    def recording_decode(tokens, positions, adapters=None):
        batches.append({a.name if a is not None else None for a in adapters or []})
        return decode(tokens, positions, adapters)

    service.runner.decode = recording_decode  # type: ignore[method-assign]  # records, then runs
    service.scheduler.start()
    generator = torch.Generator().manual_seed(7)
    rows = [*adapters, None]
    prompts = [torch.randint(3, 680, (n,), generator=generator).tolist() for n in (5, 9, 13, 7, 6)]

    async def scenario() -> list[dict]:
        for adapter, path in adapters.items():
            body = protocol.LoadLoraAdapterIn(lora_name=adapter, lora_path=str(path))
            assert (await service.load_adapter(body)).success
        return await asyncio.gather(
            *(_generate(service, p, lora, 12) for p, lora in zip(prompts, rows, strict=True))
        )

    try:
        outputs = asyncio.run(scenario())
    finally:
        service.close()
    assert max(len(batch) for batch in batches) == 5, "the five rows never decoded together"
    worst = 0.0
    for prompt, lora, output in zip(prompts, rows, outputs, strict=True):
        tokens, decoded = _logprobs(output, "output_token_logprobs")
        _, prefilled = _logprobs(output, "input_token_logprobs")
        expected = merged_logprobs(model_dir, adapters.get(lora), prompt + tokens)  # type: ignore[arg-type]
        served = torch.cat([prefilled, decoded])
        assert len(served) == len(expected) == len(prompt) - 1 + 12
        worst = max(worst, (served - expected).abs().max().item())
        if lora is not None:  # the adapter matters: the base model's logprobs are far off
            base = merged_logprobs(model_dir, None, prompt + tokens)
            assert (served - base).abs().max().item() > 100 * TOLERANCE
    print(f"{name}: max |served - float64 merged reference| = {worst:.2e}")
    assert worst <= TOLERANCE


# ----- the bank ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_runner(model_dirs) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dirs["llama"], max_slots=1))


@pytest.fixture(scope="module")
def adapter_dir(model_dirs, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter")
    return write_adapter(root / "ok", model_dirs["llama"], DEFAULT_ATTENTION, 2, 4, seed=5)


def test_load_unload_the_bound_and_duplicate_names(llama_runner, adapter_dir):
    bank = AdapterBank(llama_runner.model, max_loaded=2)
    bank.add(bank.read("x", str(adapter_dir)))
    with pytest.raises(AdapterError, match="Failed to load LoRA adapter x because it is already"):
        bank.add(bank.read("x", str(adapter_dir)))
    bank.add(bank.read("y", str(adapter_dir), pinned=True))
    assert bank.loaded()["y"].pinned and sorted(bank.loaded()) == ["x", "y"]
    with pytest.raises(AdapterError, match="2 adapters are loaded and max_loaded_loras is 2"):
        bank.add(bank.read("z", str(adapter_dir)))
    freed = bank.retire("x")
    assert freed.freed.done() and freed.weights == {} and bank.held == 1
    bank.add(bank.read("z", str(adapter_dir)))
    with pytest.raises(AdapterError, match="LoRA with name x does not exist"):
        bank.retire("x")
    with pytest.raises(AdapterError, match="not loaded: nope"):
        bank.acquire(["y", "nope"])
    assert bank.loaded()["y"].users == 0  # all or none


def test_an_adapter_in_use_is_freed_when_its_last_request_ends(llama_runner, adapter_dir):
    bank = AdapterBank(llama_runner.model, max_loaded=1)
    bank.add(bank.read("x", str(adapter_dir)))
    (held,) = bank.acquire(["x"])
    assert held is not None
    bank.retire("x")
    with pytest.raises(AdapterError, match="not loaded: x"):
        bank.acquire(["x"])  # out of service at once
    assert not held.freed.done() and held.weights and bank.held == 1
    with pytest.raises(AdapterError, match="max_loaded_loras is 1"):  # still counted
        bank.add(bank.read("x", str(adapter_dir)))
    bank.release(held)
    assert held.freed.done() and bank.held == 0
    bank.add(bank.read("x", str(adapter_dir)))  # the name is free again: a new load


def _broken(tmp: Path, source: Path, config: dict | None = None, tensors=None) -> Path:
    target = tmp / "broken"
    target.mkdir(exist_ok=True)
    base = json.loads((source / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    save_file(
        tensors if tensors is not None else load_file(source / "adapter_model.safetensors"),
        target / "adapter_model.safetensors",
    )
    return target


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"peft_type": "IA3"}, "peft_type 'IA3'; only LORA"),
        ({"use_dora": True}, "use_dora=True is not served"),
        ({"bias": "all"}, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"target_modules": ".*proj"}, "target_modules must be a non-empty list"),
        ({"target_modules": [*DEFAULT_ATTENTION, "conv"]}, r"\['conv'\] name no linear"),
        ({"target_modules": ["q_proj"]}, "not a linear module of the model matched"),
        ({"r": 0}, "r must be a positive integer"),
        ({"r": 3}, r"needs \(3, 64\)"),
        ({"lora_alpha": "8"}, "lora_alpha must be a number"),
    ],
)
def test_a_config_we_do_not_serve_is_refused_by_name(
    llama_runner, adapter_dir, tmp_path, config, message
):
    bank = AdapterBank(llama_runner.model, max_loaded=4)
    with pytest.raises(AdapterError, match=message):
        bank.read("x", str(_broken(tmp_path, adapter_dir, config)))
    assert bank.held == 0


def test_tensors_that_do_not_fit_are_refused(llama_runner, adapter_dir, tmp_path):
    bank = AdapterBank(llama_runner.model, max_loaded=4)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != a_key}, "has no lora_A"),
        ({**tensors, a_key: torch.zeros(2, 63)}, r"lora_A \(2, 63\)"),
        (
            {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
            "is not a LoRA weight",
        ),
        (
            {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
             torch.zeros(64)},
            "DoRA tensors",
        ),
        ({}, "no lora_A/lora_B tensors"),
        # a diverged run's adapter: its NaN would reach every row of a shared batch
        ({**tensors, a_key: tensors[a_key].clone().fill_(math.nan)}, "not finite"),
        ({**tensors, a_key.replace("lora_A", "lora_B"): torch.full_like(
            tensors[a_key.replace("lora_A", "lora_B")], math.inf)}, "not finite"),
        # finite in float64, infinite in the engine's float32
        ({**tensors, a_key: tensors[a_key].double().fill_(1e300)}, "not finite"),
    ]  # fmt: skip
    for broken, message in cases:
        with pytest.raises(AdapterError, match=message):
            bank.read("x", str(_broken(tmp_path, adapter_dir, tensors=broken)))
    with pytest.raises(AdapterError, match="no such directory"):
        bank.read("x", str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        bank.read("x", str(tmp_path / "empty"))
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        bank.read("x", str(tmp_path / "broken"))
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="not readable JSON"):
        bank.read("x", str(tmp_path / "broken"))


NAMES = ["p", "q", "r"]
operations = st.lists(
    st.tuples(st.sampled_from(["load", "unload", "start", "end"]), st.sampled_from(NAMES)),
    max_size=30,
)


class BankModel:
    """What the bank should hold: names in service with their running requests, and retired
    adapters with theirs; an adapter is held while in service or used, and freed exactly then."""

    def __init__(self, bank: AdapterBank, adapter_dir: Path) -> None:
        self.bank, self.adapter_dir = bank, str(adapter_dir)
        self.serving: dict[str, list] = {}
        self.retired: list[tuple[Adapter, list]] = []

    @property
    def held(self) -> int:
        return len(self.serving) + sum(bool(users) for _, users in self.retired)

    def load(self, name: str) -> None:
        adapter = self.bank.read(name, self.adapter_dir)
        if name in self.serving or self.held >= self.bank.max_loaded:
            with pytest.raises(AdapterError):
                self.bank.add(adapter)
        else:
            self.bank.add(adapter)
            self.serving[name] = []

    def unload(self, name: str) -> None:
        if name not in self.serving:
            with pytest.raises(AdapterError, match="does not exist"):
                self.bank.retire(name)
        else:
            self.retired.append((self.bank.retire(name), self.serving.pop(name)))

    def start(self, name: str) -> None:
        if name not in self.serving:
            with pytest.raises(AdapterError, match="not loaded"):
                self.bank.acquire([name])
        else:
            self.serving[name].append(self.bank.acquire([name])[0])

    def end(self, name: str) -> None:
        """The oldest request of that name ends, wherever its adapter is."""
        lists = [self.serving.get(name, [])] + [u for a, u in self.retired if a.name == name]
        users = next((u for u in lists if u), None)
        if users:
            self.bank.release(users.pop(0))

    def check(self) -> None:
        assert sorted(self.bank.loaded()) == sorted(self.serving)
        assert self.bank.held == self.held
        for adapter, users in self.retired:
            assert adapter.freed.done() == (not users)
        for name, users in self.serving.items():
            assert self.bank.loaded()[name].users == len(users)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations, st.integers(1, 3))
def test_any_sequence_of_loads_unloads_and_requests_keeps_the_bank_true(
    llama_runner, adapter_dir, ops, bound
):
    model = BankModel(AdapterBank(llama_runner.model, max_loaded=bound), adapter_dir)
    for op, name in ops:
        getattr(model, op)(name)
        model.check()


@pytest.fixture(scope="module")
def llama_service(model_dirs):
    service = EngineService(settings_for(model_dirs["llama"], max_loaded_loras=2))
    service.scheduler.start()
    yield service
    service.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["load", "unload", "generate"]), st.sampled_from([*NAMES, None])),
        max_size=12,
    )
)
def test_any_sequence_of_loads_unloads_and_generates_through_the_service(
    llama_service, adapter_dir, ops
):
    """The service against a set of loaded names: a load succeeds when the name is new and the
    bound (2) not reached, an unload when the name is loaded, a generate unless it names an
    adapter not loaded; every generate answers, and the engine ends holding what the set says."""
    service, loaded = llama_service, set()

    async def scenario() -> None:
        for name in list(service.loaded_adapters()):
            await service.unload_adapter(protocol.UnloadLoraAdapterIn(lora_name=name))
        for op, name in ops:
            if op == "generate":
                if name is not None and name not in loaded:
                    with pytest.raises(protocol.EngineInputError, match="not loaded"):
                        await _generate(service, [5, 6, 7], name, 2)
                else:
                    output = await _generate(service, [5, 6, 7], name, 2)
                    assert len(output["output_ids"]) == 2
            elif name is None:
                continue
            elif op == "load":
                body = protocol.LoadLoraAdapterIn(lora_name=name, lora_path=str(adapter_dir))
                expected = name not in loaded and len(loaded) < 2
                assert (await service.load_adapter(body)).success == expected
                loaded.update([name] if expected else [])
            else:
                body_ = protocol.UnloadLoraAdapterIn(lora_name=name)
                assert (await service.unload_adapter(body_)).success == (name in loaded)
                loaded.discard(name)
            assert set(service.loaded_adapters()) == loaded

    asyncio.run(scenario())
    assert service.runner.adapters.held == len(loaded)


# ----- the prefix cache and unloads under load --------------------------------------------------


def test_the_same_prompt_under_two_adapters_never_shares_kv(model_dirs, tmp_path):
    model_dir = model_dirs["llama"]
    adapters = four_adapters(tmp_path, "llama", model_dir)
    service = EngineService(settings_for(model_dir, prefix_cache_min_tokens=4))
    service.scheduler.start()
    prompt = list(range(20, 60))

    async def scenario() -> list[dict]:
        for adapter in ("a@1", "b@1"):
            body = protocol.LoadLoraAdapterIn(lora_name=adapter, lora_path=str(adapters[adapter]))
            assert (await service.load_adapter(body)).success
        outputs = []
        for lora in ("a@1", "b@1", None, "a@1"):  # one after another: each finds the others'
            request = protocol.GenerateRequestIn(
                input_ids=prompt,
                sampling_params={"max_new_tokens": 4, "ignore_eos": True},
                return_logprob=True,
                lora_path=lora,
            )
            items, _ = service.parse(request)
            outputs.append((await service.generate(request, items))[0])
            outputs[-1]["hits"] = service.prefix_cache_info()["hits"]
        return outputs

    try:
        outputs = asyncio.run(scenario())
    finally:
        service.close()
    assert [o["hits"] for o in outputs] == [0, 0, 0, 1]  # only a@1's second request reuses
    for output, lora in zip(outputs, ("a@1", "b@1", None, "a@1"), strict=True):
        tokens, served = _logprobs(output, "output_token_logprobs")
        expected = merged_logprobs(model_dir, adapters.get(lora), prompt + tokens)  # type: ignore[arg-type]
        assert (served - expected[len(prompt) - 1 :]).abs().max().item() <= TOLERANCE


def test_an_unload_waits_for_the_requests_using_it(model_dirs, tmp_path):
    """Loading another adapter and unloading the one a request runs with, while it runs: new
    requests naming it are refused at once, the running one finishes exactly, then the unload
    answers and the adapter is gone."""
    model_dir = model_dirs["llama"]
    adapters = four_adapters(tmp_path, "llama", model_dir)
    service = EngineService(settings_for(model_dir))
    service.scheduler.start()
    prompt = list(range(30, 40))

    async def scenario() -> tuple[dict, bool]:
        body = protocol.LoadLoraAdapterIn(lora_name="a@1", lora_path=str(adapters["a@1"]))
        assert (await service.load_adapter(body)).success
        running = asyncio.ensure_future(_generate(service, prompt, "a@1", 120))
        while not service.scheduler.running:
            await asyncio.sleep(0.001)
        other = protocol.LoadLoraAdapterIn(lora_name="b@1", lora_path=str(adapters["b@1"]))
        assert (await service.load_adapter(other)).success  # a load between its steps
        unload = asyncio.ensure_future(
            service.unload_adapter(protocol.UnloadLoraAdapterIn(lora_name="a@1"))
        )
        while "a@1" in service.loaded_adapters():
            await asyncio.sleep(0.001)
        with pytest.raises(protocol.EngineInputError, match="not loaded: a@1"):
            await _generate(service, prompt, "a@1", 1)
        unloaded_first = unload.done()
        output = await running
        assert (await unload).success
        return output, unloaded_first

    try:
        output, unloaded_first = asyncio.run(scenario())
    finally:
        service.close()
    assert not unloaded_first and service.runner.adapters.held == 1  # b@1
    tokens, decoded = _logprobs(output, "output_token_logprobs")
    assert len(tokens) == 120
    expected = merged_logprobs(model_dir, adapters["a@1"], prompt + tokens)[len(prompt) - 1 :]
    assert (decoded - expected).abs().max().item() <= TOLERANCE


# ----- HTTP -----------------------------------------------------------------------------------

ADMIN = "lora-admin-key-" + "0123456789abcdef" * 2


@pytest.fixture
def client(model_dirs):
    service = EngineService(settings_for(model_dirs["llama"], admin_api_key=ADMIN))
    service.scheduler.start()
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def test_the_routes_answer_in_sglangs_shapes(client, adapter_dir, tmp_path):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"lora_name": "run@1", "lora_path": str(adapter_dir)}
    assert client.post("/load_lora_adapter", json=body).status_code == 401
    loaded = client.post("/load_lora_adapter", json=body, headers=admin)
    assert loaded.status_code == 200
    assert loaded.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"run@1": str(adapter_dir)},
    }
    again = client.post("/load_lora_adapter", json=body, headers=admin)
    assert again.status_code == 400 and again.json()["success"] is False
    assert "already loaded" in again.json()["error_message"]
    broken = _broken(tmp_path, adapter_dir, {"use_dora": True})
    refused = client.post(
        "/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(broken)}, headers=admin
    )
    assert refused.status_code == 400 and "use_dora" in refused.json()["error_message"]
    assert refused.json()["loaded_adapters"] == {"run@1": str(adapter_dir)}  # nothing half-done
    no_name = client.post("/load_lora_adapter", json={"lora_path": "x"}, headers=admin)
    assert no_name.status_code == 400 and no_name.json()["object"] == "error"

    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models][1:] == ["run@1"]
    assert models[1]["parent"] == models[0]["id"] and models[1]["root"] == str(adapter_dir)
    assert models[1]["max_model_len"] is None
    assert client.get("/v1/models/run@1").status_code == 404  # SGLang finds the base only

    generate = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2}}
    ok = client.post("/generate", json={**generate, "lora_path": ["run@1", None]})
    assert ok.status_code == 200 and len(ok.json()) == 2
    unknown = client.post("/generate", json={**generate, "lora_path": "nope"})
    assert unknown.status_code == 400
    assert "not loaded: nope" in unknown.json()["error"]["message"]
    short = client.post("/generate", json={**generate, "lora_path": ["run@1"]})
    assert short.status_code == 400
    assert "lora_path has 1 entries" in short.json()["error"]["message"]
    wrong_type = client.post("/generate", json={**generate, "lora_path": 3})
    assert wrong_type.status_code == 400 and "lora_path" in wrong_type.json()["error"]

    assert client.post("/unload_lora_adapter", json={"lora_name": "run@1"}).status_code == 401
    gone = client.post("/unload_lora_adapter", json={"lora_name": "run@1"}, headers=admin)
    assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {}
    twice = client.post("/unload_lora_adapter", json={"lora_name": "run@1"}, headers=admin)
    assert twice.status_code == 400 and "does not exist" in twice.json()["error_message"]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]][1:] == []
    assert client.get("/v1/models/run@1").status_code == 404


# ----- peft's own files -------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft's call
@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_an_adapter_peft_saved_serves_what_peft_computes(name, model_dirs, tmp_path):
    """The contract from the other side: an adapter written by peft's ``save_pretrained``
    (random non-zero B) loads, and the engine's prefill logprobs (float32) equal peft's own
    forward of base + adapter in float64 within ``TOLERANCE``; a DoRA adapter peft saved is
    refused by name."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model_dir = model_dirs[name]
    targets = ["query_key_value", "dense_4h_to_h"] if name == "gpt_neox" else ["v_proj", "up_proj"]
    torch.manual_seed(11)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(tmp_path / "peft")
    dora = LoraConfig(r=4, lora_alpha=12, target_modules=targets, use_dora=True)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), dora).save_pretrained(
        tmp_path / "dora"
    )

    runner = ModelRunner(RunnerConfig(model_dir, max_slots=1))
    with pytest.raises(AdapterError, match="use_dora=True is not served"):
        runner.adapters.read("dora", str(tmp_path / "dora"))
    adapter = runner.adapters.read("peft", str(tmp_path / "peft"))
    runner.adapters.add(adapter)
    ids = list(range(40, 70))
    chunks: list[torch.Tensor] = []
    runner.prefill(0, ids, on_logits=lambda _start, logits: chunks.append(logits), adapter=adapter)
    served = torch.log_softmax(torch.cat(chunks).double(), dim=-1)[:-1]
    served = served.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64), tmp_path / "peft"
    ).eval()
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    base_only = merged_logprobs(model_dir, None, ids)
    assert (served - base_only).abs().max().item() > 100 * TOLERANCE  # the adapter matters
    assert (served - expected).abs().max().item() <= TOLERANCE
