"""LoRA runs in the trainer (``TrainConfig.lora``): the config, the adapter's forward, and a
FSDP2 worker (world size 1, gloo) that trains, checkpoints and publishes the adapter alone.

The forward is held to LoRA's definition (Hu et al. 2021, arXiv 2106.09685, eq. 3):
h = W0 x + (alpha / r) B A x, i.e. the model whose every target Linear has the merged weight
W0 + (alpha / r) B A (alpha / sqrt(r) with rsLoRA, arXiv 2312.03732). The reference merges a
random A and B into a float64 copy of the base by hand; the peft-wrapped float64 model must
give the same logits to ``EXACT`` = 1e-10 (measured: equal to the bit on llama, qwen2, qwen3
and gemma2, 3.3e-15 on gpt_neox, on logits of size ~3 that the adapter moves by 1.9 to 4).

The worker's checks: a train step moves the adapter and leaves every base tensor equal to the
bit, and the optimizer holds the adapter's parameters alone; version 0 is the base model; the
KL reference is the base (the adapter disabled); a checkpoint holds the adapter and its
optimizer state alone and a resumed worker's next step equals the uninterrupted one to the
bit; a publish writes peft's ``save_pretrained`` directory, which peft's
``PeftModel.from_pretrained`` loads onto the base to the trained worker's logprobs within
``PUBLISHED`` = 1e-6 (float32 both sides).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import peft
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.support import free_port
from tests.unit.test_algorithm import (
    ALGORITHMS,
    FSDP_TOLERANCE,
    PlainBackend,
    make_samples,
    random_rows,
    with_rewards,
)
from trainer.algorithm import train_step
from trainer.batching import packed, shift_logprobs
from trainer.config import ConfigError, LoraConfig, OptimConfig, load_config
from trainer.model import check_supported, decoder_layers, load_model, lora_targets, with_lora
from trainer.plan import MicroBatch, plan_step
from trainer.publish import Publisher
from trainer.server_api import ServerAPI
from trainer.worker import Worker, WorkerSettings

EXACT = 1e-10  # float64 against float64
F64 = torch.float64
PUBLISHED = 1e-6  # float32 against float32, the same weights
FAST = ("llama", "qwen2", "qwen3", "gemma2", "gpt_neox")
BASE = ["server=http://127.0.0.1:9"]
ALGORITHM = replace(ALGORITHMS["decoupled_capped"], kl_coef=0.1)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the config ------------------------------------------------------------------------------


def test_no_lora_section_is_a_full_weight_run():
    assert load_config(None, BASE).lora is None
    assert load_config(None, [*BASE, "lora=null"]).lora is None


def test_any_lora_option_turns_it_on_with_defaults_for_the_rest():
    config = load_config(None, [*BASE, "lora.rank=4", "lora.target_modules=[q_proj, v_proj]"])
    assert config.lora == LoraConfig(rank=4, target_modules=("q_proj", "v_proj"))
    assert load_config(None, [*BASE, "lora={}"]).lora == LoraConfig()
    assert load_config(None, [*BASE, "lora={}", "algorithm.critic=true"]).algorithm.critic


@settings(max_examples=40, deadline=None)
@given(
    rank=st.integers(-3, 64),
    alpha=st.floats(-4, 64, allow_nan=False),
    dropout=st.floats(-0.5, 1.5, allow_nan=False),
)
def test_lora_bounds_are_checked_at_load_naming_the_field(rank, alpha, dropout):
    overrides = [*BASE, f"lora.rank={rank}", f"lora.alpha={alpha}", f"lora.dropout={dropout}"]
    bad = {
        "lora.rank": rank < 1,
        "lora.alpha": alpha <= 0,
        "lora.dropout": not 0 <= dropout < 1,
    }
    if not any(bad.values()):
        assert load_config(None, overrides).lora == LoraConfig(rank, alpha, (), dropout)
        return
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert bad[caught.value.field_name]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["lora.bogus=1"], "lora.bogus"),
        (["lora=3"], "lora"),
        (["lora.target_modules=['']"], "lora.target_modules"),
        (["lora.rank=8", "publish.mode=distributed"], "publish.mode"),
    ],
)
def test_what_a_lora_run_cannot_do_is_refused_at_load(overrides, field):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*BASE, *overrides])
    assert caught.value.field_name == field


def test_the_lora_example_loads():
    example = Path(__file__).parents[2] / "examples" / "train-lora.yaml"
    assert load_config(example, BASE).lora is not None


# --- targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAST)
def test_default_targets_are_every_linear_of_the_decoder_layers(model_dirs, name):
    model = load_model(model_dirs[name])
    linears = {
        full.rsplit(".", 1)[-1]
        for full, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in full
    }
    assert set(lora_targets(model, LoraConfig())) == linears
    assert "lm_head" not in linears and len(linears) >= 4  # attention and MLP projections


def test_a_target_the_model_lacks_is_a_config_error_before_any_weight_loads(model_dirs):
    lora = LoraConfig(target_modules=("q_proj", "query_key_value"))
    with pytest.raises(ConfigError, match="query_key_value") as caught:
        check_supported(model_dirs["llama"], lora)
    assert caught.value.field_name == "lora.target_modules"
    check_supported(model_dirs["gpt_neox"], replace(lora, target_modules=("query_key_value",)))


# --- the forward, against eq. 3 of the paper ---------------------------------------------------


def merged_reference(model_dir: str, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]], scale):
    """The base in float64 with W0 + scale * B @ A written into each adapted Linear."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for path, (a, b) in adapter.items():
            modules[path].weight += scale * (b @ a)
    return model


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("name", FAST)
def test_the_lora_forward_is_the_merged_weights_in_float64(model_dirs, name, rslora):
    rank, alpha = 3, 5.0
    base = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64).eval()
    wrapped = with_lora(base, LoraConfig(rank=rank, alpha=alpha, use_rslora=rslora)).eval()
    generator = torch.Generator().manual_seed(1)
    adapter = {}
    with torch.no_grad():
        for path, module in wrapped.base_model.model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                layer = module.base_layer
                # entries of 0.1, as the model's own (INIT): the adapter's delta is of the size of
                # W0's, and attention stays far from saturated (where errors would not show)
                a = 0.1 * torch.randn(rank, layer.in_features, generator=generator, dtype=F64)
                b = 0.1 * torch.randn(layer.out_features, rank, generator=generator, dtype=F64)
                module.lora_A["default"].weight.copy_(a)
                module.lora_B["default"].weight.copy_(b)
                assert module.lora_A["default"].weight.dtype == torch.float64
                adapter[path] = (a, b)
    assert adapter
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    reference = merged_reference(model_dirs[name], adapter, scale)
    ids = torch.randint(3, 680, (1, 21), generator=generator)
    with torch.no_grad():
        got = wrapped(input_ids=ids, use_cache=False).logits
        want = reference(input_ids=ids, use_cache=False).logits
        plain = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64)
        base_logits = plain(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max() <= EXACT
    assert (got - base_logits).abs().max() > 1e-2  # the adapter changes the model


# --- a worker --------------------------------------------------------------------------------


@contextmanager
def worker(model_dir, lora: LoraConfig | None = None, algorithm=ALGORITHM) -> Iterator[Worker]:
    settings = WorkerSettings(
        model_dir=str(model_dir), lr=1e-2, optim=OptimConfig(), algorithm=algorithm,
        seed=0, device="cpu", threads=1, lora=lora,
    )  # fmt: skip
    built = Worker(0, 1, settings)
    built.setup("127.0.0.1", free_port())
    try:
        yield built
    finally:
        built.shutdown()


def samples(seed: int = 3) -> list:
    """Six rows whose behaviour logprobs are about -5 (the tiny model's are near -6.5)."""
    return make_samples(lambda ids: [0.0] + [-5.0] * (len(ids) - 1), random_rows(seed, 6), 3)


def steps(seed: int = 3, world_size: int = 1):
    return plan_step(samples(seed), world_size, minibatch_count=2, max_tokens=64)


def step(trainer: Worker, seed: int = 3) -> dict:
    plan = steps(seed)
    return trainer.train_step(plan.per_rank[0], plan.tokens, plan.sequences, ALGORITHM)


def named(trainer: Worker, trainable: bool) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().full_tensor().clone()
        for name, p in trainer.model.named_parameters()
        if p.requires_grad == trainable
    }


def micro() -> MicroBatch:
    plan = steps(5)
    return plan.per_rank[0][0][0]


def test_a_step_trains_the_adapter_alone(tiny_model_dir):
    with worker(tiny_model_dir, LoraConfig(rank=4, alpha=8.0)) as trainer:
        base, adapter = named(trainer, False), named(trainer, True)
        held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        assert {id(p) for p in held} == {
            id(p) for p in trainer.model.parameters() if p.requires_grad
        }
        assert adapter and all(".lora_" in name for name in adapter)
        assert len(base) > 0 and not any(".lora_" in name for name in base)
        step(trainer)
        after_base, after_adapter = named(trainer, False), named(trainer, True)
    assert all(torch.equal(base[name], after_base[name]) for name in base)
    moved = [name for name in adapter if not torch.equal(adapter[name], after_adapter[name])]
    assert set(moved) == set(adapter)  # every A and every B took a step


def test_version_0_is_the_base_model_and_the_reference_stays_it(tiny_model_dir):
    with worker(tiny_model_dir) as full:
        base = full.forward(micro()).logprobs
    with worker(tiny_model_dir, LoraConfig(rank=4, alpha=8.0)) as trainer:
        assert torch.equal(trainer.forward(micro()).logprobs, base)
        assert trainer.reference_model is None  # the adapter disabled is the reference
        step(trainer)
        trained = trainer.forward(micro()).logprobs
        reference = trainer.reference(micro())
        assert trainer.forward(micro()).logprobs.equal(trained)  # the adapter is back on
    assert reference is not None and torch.equal(reference, base)
    assert (trained - base).abs().max() > 1e-3


def test_adapter_dropout_runs_in_the_gradient_forward_only(tiny_model_dir):
    with worker(tiny_model_dir, LoraConfig(rank=4, alpha=8.0, dropout=0.5)) as trainer:
        step(trainer)  # B leaves zero: dropout on A's input now shows
        first, second = (trainer.forward(micro()).logprobs for _ in range(2))
        with_grad = trainer.forward(micro(), grad=True).logprobs.detach()
        assert all(not m.training for m in trainer.adapter_dropouts)
    assert trainer.adapter_dropouts and torch.equal(first, second)
    assert (with_grad - first).abs().max() > 1e-4


def test_a_checkpoint_holds_the_adapter_and_resumes_to_the_bit(tiny_model_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0)
    with worker(tiny_model_dir) as full:
        full.save_checkpoint(str(tmp_path / "full"))
    with worker(tiny_model_dir, lora) as trainer:
        step(trainer, 3)
        trainer.save_checkpoint(str(tmp_path / "lora"))
        saved = named(trainer, True)
        going_on = step(trainer, 4)
        after = named(trainer, True)
    state = torch.load(tmp_path / "lora" / "train_state.pt", weights_only=True)
    assert set(state["model"]) == set(saved)
    assert all(torch.equal(state["model"][name], saved[name]) for name in saved)
    assert len(state["optimizer"]["state"]) == len(saved)
    with worker(tiny_model_dir, lora) as resumed:
        assert resumed.load_checkpoint(str(tmp_path / "lora")) == 1
        restored = named(resumed, True)
        assert all(torch.equal(restored[name], saved[name]) for name in saved)
        again = step(resumed, 4)
        after_again = named(resumed, True)
    timings = {"seconds", "proximal_seconds"}
    assert {k: v for k, v in again.items() if k not in timings} == {
        k: v for k, v in going_on.items() if k not in timings
    }
    assert all(torch.equal(after_again[name], after[name]) for name in after)
    full_bytes = (tmp_path / "full" / "train_state.pt").stat().st_size
    lora_bytes = (tmp_path / "lora" / "train_state.pt").stat().st_size
    print(f"checkpoint bytes: full {full_bytes}, lora {lora_bytes}")
    assert lora_bytes < full_bytes / 5


def test_a_checkpoint_of_the_other_kind_is_refused(tiny_model_dir, tmp_path):
    with worker(tiny_model_dir, LoraConfig(rank=4)) as trainer:
        trainer.save_checkpoint(str(tmp_path / "lora"))
    with worker(tiny_model_dir) as full, pytest.raises(RuntimeError, match="LoRA adapter"):
        full.load_checkpoint(str(tmp_path / "lora"))
    with worker(tiny_model_dir, LoraConfig(rank=2)) as other, pytest.raises(RuntimeError) as no:
        other.load_checkpoint(str(tmp_path / "lora"))
    assert "'rank': 4" in str(no.value)


def peft_logprobs(model_dir, adapter_dir: Path, rows: list[list[int]]) -> torch.Tensor:
    """The packed rows' logprobs (at the step's temperature) of the base with the adapter at
    ``adapter_dir`` loaded by peft's own ``PeftModel.from_pretrained``."""
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        loaded = peft.PeftModel.from_pretrained(load_model(model_dir), str(adapter_dir)).eval()
    batch = packed(rows)
    with torch.no_grad():
        logits = loaded(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            cu_seq_lens_q=batch.cu_seqlens,
            use_cache=False,
        ).logits[0]
    return shift_logprobs(
        logits.float() / ALGORITHM.temperature, batch.input_ids[0], batch.cu_seqlens
    )


def test_a_publish_is_peft_s_adapter_directory(tiny_model_dir, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    with worker(tiny_model_dir) as full:
        full.save_weights(str(tmp_path / "full"))
    with worker(tiny_model_dir, lora) as trainer:
        step(trainer)
        trainer.save_weights(str(tmp_path / "v000001"))
        trained = trainer.forward(micro()).logprobs
        rows = micro().rows
    out = tmp_path / "v000001"
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "proxrl.json",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    tensors = load_file(out / "adapter_model.safetensors")
    layers = len(decoder_layers(load_model(tiny_model_dir)))
    assert len(tensors) == 2 * 3 * layers
    for name, tensor in tensors.items():
        assert name.startswith("base_model.model.model.layers.")
        assert name.endswith((".lora_A.weight", ".lora_B.weight"))
        assert tensor.shape[0 if name.endswith("A.weight") else 1] == 4
    adapter_bytes = (out / "adapter_model.safetensors").stat().st_size
    full_bytes = (tmp_path / "full" / "model.safetensors").stat().st_size
    print(f"published bytes: full {full_bytes}, adapter {adapter_bytes}")
    assert adapter_bytes < full_bytes / 20
    got = peft_logprobs(tiny_model_dir, out, rows)
    assert (got - trained).abs().max() <= PUBLISHED


@pytest.mark.parametrize("name", FAST)
def test_each_architecture_trains_and_publishes_its_adapter(model_dirs, name, tmp_path):
    """The fast subset's layouts (fused QKV and parallel residual in GPT-NeoX, tied embeddings
    in Qwen2/3 and Gemma2, soft-capping in Gemma2), each with its default targets."""
    with worker(model_dirs[name], LoraConfig(rank=4, alpha=8.0)) as trainer:
        base = named(trainer, False)
        step(trainer)
        assert all(torch.equal(t, base[n]) for n, t in named(trainer, False).items())
        trainer.save_weights(str(tmp_path / "v1"))
        trained = trainer.forward(micro()).logprobs
    got = peft_logprobs(model_dirs[name], tmp_path / "v1", micro().rows)
    assert (got - trained).abs().max() <= PUBLISHED


class OneWorker:
    """`trainer.cluster.WorkerGroup`'s ``call`` on one in-process worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def call(self, method: str, *args):
        return [getattr(self.worker, method)(*args)]


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4)], ids=["full", "lora"])
def test_the_publish_hands_the_server_an_adapter_path(tiny_model_dir, tmp_path, lora):
    overrides = [*BASE, f"output_dir={tmp_path}"] + (["lora.rank=4"] if lora else [])
    config = load_config(None, overrides)
    bodies = []

    def server(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"policy_version": 1})

    api = ServerAPI(config.server, "key", 5.0)
    api.http = httpx.Client(base_url=api.url, transport=httpx.MockTransport(server))
    with worker(tiny_model_dir, lora) as trainer:
        Publisher(config, api, "run-1", OneWorker(trainer), tmp_path).publish(1)  # type: ignore[arg-type]
    path = str(tmp_path / "weights" / "v000001")
    source = "adapter_path" if lora else "model_path"
    assert bodies == [("/admin/weights", {"run_id": "run-1", source: path, "version": 1})]
    written = "adapter_config.json" if lora else "model.safetensors"
    assert (Path(path) / written).exists()


def test_the_workers_are_given_the_run_s_lora_settings():
    from trainer.loop import worker_settings

    config = load_config(None, [*BASE, "lora.rank=4", "lora.target_modules=[q_proj]"])
    settings = worker_settings(config, "/models/base", ALGORITHM)
    assert settings.lora == LoraConfig(rank=4, target_modules=("q_proj",))
    assert worker_settings(load_config(None, BASE), "/models/base", ALGORITHM).lora is None


def head_state(trainer: Worker) -> dict[str, torch.Tensor]:
    assert trainer.value_head is not None
    return {k: v.clone() for k, v in trainer.value_head.state_dict().items()}


@pytest.mark.parametrize("critic", [False, True], ids=["kl", "critic"])
def test_the_worker_s_lora_step_is_a_plain_peft_model_s(tiny_model_dir, tmp_path, critic):
    """The FSDP2 worker's step on the adapter is the step of `PlainBackend` (tests/unit/
    test_algorithm.py: plain autograd, one unsharded module) on a peft-wrapped copy of the base
    with the same starting adapter, AdamW and clip: with the base itself as the KL reference,
    or with the critic's value head (on the adapted trunk's last hidden state) learning beside
    the adapter. The same adapter and head to ``FSDP_TOLERANCE`` of the largest change
    (measured: equal to the bit), the same figures (the KL to the reference among them); the
    head survives a checkpoint and is never published."""
    lora = LoraConfig(rank=4, alpha=8.0)
    optim = OptimConfig()
    algorithm = ALGORITHM
    if critic:
        algorithm = replace(ALGORITHM, kl_coef=0.0, critic=True, value_clip=0.05)
    rows = with_rewards(samples(3), 3) if critic else samples(3)  # GAE: rewards, not advantages
    plan = plan_step(rows, 1, minibatch_count=2, max_tokens=64)
    with worker(tiny_model_dir, lora, algorithm) as trainer:
        start = named(trainer, True)
        head_start = head_state(trainer) if critic else None
        sharded = trainer.train_step(plan.per_rank[0], plan.tokens, plan.sequences, algorithm)
        after = named(trainer, True)
        head_after = head_state(trainer) if critic else {}
        if critic:
            trainer.save_checkpoint(str(tmp_path / "checkpoint"))
            trainer.save_weights(str(tmp_path / "v1"))
            trainer.load_checkpoint(str(tmp_path / "checkpoint"))
            restored = head_state(trainer)
            assert all(torch.equal(restored[k], head_after[k]) for k in head_after)
            published = load_file(tmp_path / "v1" / "adapter_model.safetensors")
            assert all(".lora_" in name for name in published)
    model = with_lora(load_model(tiny_model_dir), lora)
    adapter = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(adapter) == set(start)
    with torch.no_grad():
        for name, parameter in adapter.items():
            parameter.copy_(start[name])
    groups: list[dict] = [{"params": list(adapter.values())}]
    head = None
    if head_start is not None:
        head = torch.nn.Linear(model.config.hidden_size, 1)
        head.load_state_dict(head_start)
        groups.append({"params": list(head.parameters()), "value_head": True})
    adamw = torch.optim.AdamW(
        groups, lr=1e-2, betas=(optim.beta1, optim.beta2), eps=optim.eps,
        weight_decay=optim.weight_decay,
    )  # fmt: skip
    reference = None if critic else load_model(tiny_model_dir).requires_grad_(False)
    backend = PlainBackend(
        model.get_base_model(),  # the base with peft's adapters in its Linears
        adamw, grad_clip=optim.grad_clip, reference_model=reference, value_head=head,
        value_lr_scale=algorithm.value_lr_scale,
    )  # fmt: skip
    plain = train_step(backend, plan.per_rank[0], plan.tokens, plan.sequences, algorithm, lr=1e-2)
    change = max(float((after[n] - start[n]).abs().max()) for n in start)
    gap = max(float((after[n] - adapter[n].detach()).abs().max()) for n in start)
    print(f"worker against plain: largest gap {gap:.3g} of a change of {change:.3g}")
    assert change > 1e-3 and gap <= FSDP_TOLERANCE * change
    if head is not None:
        head_change = max(float((head_after[k] - head_start[k]).abs().max()) for k in head_after)
        plain_head = head.state_dict()
        head_gap = max(float((head_after[k] - plain_head[k]).abs().max()) for k in head_after)
        assert head_change > 1e-3 and head_gap <= FSDP_TOLERANCE * head_change
    for key in plain.keys() - {"seconds", "proximal_seconds"}:
        assert sharded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
