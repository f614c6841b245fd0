"""The trainer computes the checkpoint's model, for every architecture in tests/architectures.py.

Each model is loaded the way a worker loads it (``trainer.model.load_model``: float32, the
packed attention of ``trainer/attention.py``) and runs one packed forward of four rows of
different lengths (5, 19, 33 and 27 tokens: the window of 8 is crossed, and the 33-token row
takes the block-by-block path). The logprob of every token must equal a float64 forward of its
row alone with the model's own attention and masks (``tests.architectures.reference_logprobs``)
within ``TOLERANCE`` = 1e-4 nats (float32 against float64 on logprobs of magnitude ~6).
Measured max diffs: llama 1.6e-6, qwen2 1.4e-6, qwen3 1.5e-6, mistral 1.2e-6, gemma2 7.5e-7,
gemma3 1.1e-6, phi3 1.3e-6, gpt_neox 9.8e-7, qwen3_moe 1.2e-6.

That tolerance would catch the bugs it is there for: the same forward with the windows
ignored is off by 1.6 (mistral), 2.4 (gemma2), 1.9 (gemma3) and 2.3 (phi3) nats, and with
Gemma2's attention soft-cap ignored by 0.093 nats; ``test_ignoring_a_feature_is_caught`` keeps
each above ``SENSITIVITY`` (0.05, 500 times the tolerance).

Gradients of the packed float32 forward equal per-row float64 gradients on the windowed and
soft-capped models within ``GRADIENT_TOLERANCE`` = 1e-5 of the largest gradient entry
(measured: mistral 7.2e-6 against a largest entry of 13.3, gemma2 6.0e-6 against 11.8, both
about 5e-7 of it). Every attention path keeps its backward consistent with its forward under
dropout. Tied embeddings stay one tensor through a worker's step, its published weights and a
checkpoint round trip (``test_a_tied_model_stays_tied_through_training``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AttentionInterface, AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig

from server.common.weight_transfer import read_checkpoint
from tests import architectures, support
from trainer import attention
from trainer.batching import packed, shift_logprobs
from trainer.model import (
    UnsupportedModel,
    check_supported,
    decoder_layers,
    load_model,
    output_embedding_name,
)
from trainer.plan import plan_step
from trainer.rollouts import Sample
from trainer.worker import Worker

TOLERANCE = 1e-4
SENSITIVITY = 0.05
GRADIENT_TOLERANCE = 1e-5
LENGTHS = (5, 19, 33, 27)
VOCAB = (3, 680)  # token ids the tiny tokenizer's 688-token vocabulary holds, specials left out


@pytest.fixture(scope="module")
def rows() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(*VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(model_dirs, rows):
    """Per architecture (computed once): the float64 logprobs of each row alone, laid out as
    the packed ones are (0 at each row's first token)."""
    cache: dict[str, torch.Tensor] = {}

    def reference(name: str) -> torch.Tensor:
        if name not in cache:
            zero = torch.zeros(1, dtype=torch.float64)
            cache[name] = torch.cat(
                [
                    torch.cat([zero, architectures.reference_logprobs(model_dirs[name], row)])
                    for row in rows
                ]
            )
        return cache[name]

    return reference


def packed_logprobs(model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    """The worker's forward: one packed sequence, positions restarting per row, no cache."""
    batch = packed(rows)
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        cu_seq_lens_q=batch.cu_seqlens,
        use_cache=False,
    ).logits[0]
    return shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_packed_forward_equals_the_reference(name, model_dirs, rows, references):
    model = load_model(model_dirs[name]).eval()
    with torch.no_grad():
        logprobs = packed_logprobs(model, rows)
    error = (logprobs.double() - references(name)).abs().max().item()
    print(f"{name}: max |packed - float64 reference| = {error:.1e}")
    assert error <= TOLERANCE


def _without(feature: str):
    """The packed attention with one keyword dropped: the bug the matrix is there to catch."""

    def forward(*args, **kwargs):
        kwargs.pop(feature, None)
        return attention.packed_attention(*args, **kwargs)

    return forward


@pytest.mark.parametrize(
    ("name", "feature"),
    [(name, "sliding_window") for name in architectures.WINDOWED] + [("gemma2", "softcap")],
)
def test_ignoring_a_feature_is_caught(name, feature, model_dirs, rows, references, monkeypatch):
    buggy = f"{attention.NAME}_without_{feature}"
    AttentionInterface.register(buggy, _without(feature))
    if feature == "sliding_window":  # the config's windows, too
        monkeypatch.setattr(
            attention, "layer_windows", lambda config: [None] * architectures.LAYERS
        )
    model = AutoModelForCausalLM.from_pretrained(
        model_dirs[name], dtype=torch.float32, attn_implementation=buggy
    ).eval()
    with torch.no_grad():
        logprobs = packed_logprobs(model, rows)
    error = (logprobs.double() - references(name)).abs().max().item()
    print(f"{name} without {feature}: max |packed - float64 reference| = {error:.3f}")
    assert error > SENSITIVITY


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_packed_gradients_equal_per_row_gradients(name, model_dirs, rows):
    """d(sum of weighted logprobs)/d(parameters): packed float32 against each row alone in
    float64 with the model's own attention (Gemma2: eager), relative to the largest entry."""
    weights = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(1))
    reference = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    per_row = []
    for row in rows:
        ids = torch.tensor([row])
        logits = reference(input_ids=ids, use_cache=False).logits[0]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        per_row.append(torch.cat([zero, logp]))
    (torch.cat(per_row) * weights.double()).sum().backward()

    model = load_model(model_dirs[name])
    (packed_logprobs(model, rows) * weights).sum().backward()
    expected = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in expected.values())
    worst = max(
        (p.grad.double() - expected[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    print(f"{name}: max gradient diff {worst:.1e}, largest gradient entry {scale:.1f}")
    assert worst <= GRADIENT_TOLERANCE * scale


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_every_attention_path_backpropagates_what_it_computed(model_dirs, dropout):
    """Each path (causal; a band; blocks; soft-capped, recomputed in the backward) under
    dropout: attention is linear in the values, so sum(v * d<out, w>/dv) must equal <out, w>.
    A backward that drew another dropout mask than the forward (the recomputed soft-capped
    path) would break the identity."""
    model = load_model(model_dirs["gemma2"])
    sliding, full = (layer.self_attn for layer in model.model.layers)  # windows [8, None]
    bounds = torch.tensor([0, 5, 24, 57], dtype=torch.int32)  # rows of 5, 19 and 33 tokens
    generator = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(1, 4, 57, 16, generator=generator, requires_grad=True) for _ in range(3)
    )
    weights = torch.randn(1, 57, 4, 16, generator=generator)
    for module, softcap in ((full, None), (sliding, None), (sliding, 2.0)):
        kwargs = {"cu_seq_lens_q": bounds, "softcap": softcap}
        torch.manual_seed(4)
        out, _ = attention.packed_attention(module, query, key, value, None, dropout, **kwargs)
        total = (out * weights).sum()
        (grad,) = torch.autograd.grad(total, value)
        assert (value * grad).sum().item() == pytest.approx(total.item(), rel=1e-5, abs=1e-5)
        with torch.no_grad():
            plain, _ = attention.packed_attention(module, query, key, value, None, 0.0, **kwargs)
        assert torch.equal(out, plain) == (dropout == 0.0)


def test_attention_keywords_it_does_not_compute_are_refused(model_dirs):
    model = load_model(model_dirs["mistral"])
    module = model.model.layers[0].self_attn
    q = k = v = torch.zeros(1, 4, 6, 16)
    bounds = torch.tensor([0, 6], dtype=torch.int32)
    sinks = torch.zeros(4)
    with pytest.raises(ValueError, match="'s_aux'"):
        attention.packed_attention(module, q, k, v, None, cu_seq_lens_q=bounds, s_aux=sinks)
    with pytest.raises(ValueError, match="sliding_window=4 but its config declares 8"):
        attention.packed_attention(module, q, k, v, None, cu_seq_lens_q=bounds, sliding_window=4)
    with pytest.raises(ValueError, match="is_causal"):
        attention.packed_attention(module, q, k, v, None, cu_seq_lens_q=bounds, is_causal=False)


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_fsdp_shards_exactly_the_decoder_layers(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(architectures.ARCHITECTURES[name]())
    layers = decoder_layers(model)
    assert len(layers) == architectures.LAYERS
    assert {id(m) for m in layers} == {id(m) for m in model.base_model.layers}


def test_a_model_without_declared_layers_is_refused():
    with pytest.raises(UnsupportedModel, match="_no_split_modules"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_model_with_unsupported_attention_is_refused_naming_it(tmp_path):
    Gemma3TextConfig(use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        check_supported(tmp_path)
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        load_model(tmp_path)  # before any weight is read: there are none


# ----- the worker: sharding, tied embeddings, publishing, checkpoints ----------------------------


def start_worker(model_dir: str | Path) -> Worker:
    return support.start_worker(model_dir, lr=1e-2)


def samples(rows: list[list[int]]) -> list[Sample]:
    out = []
    for i, ids in enumerate(rows):
        mask = [0] * 2 + [1] * (len(ids) - 2)
        out.append(
            Sample(
                session_id=f"s{i}",
                input_ids=ids,
                loss_mask=mask,
                behaviour=[-6.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[(1.0 if i % 2 else -1.0) * m for m in mask],
            )
        )
    return out


def embeddings(model) -> tuple[torch.Tensor, torch.Tensor]:
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    inputs, outputs = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert outputs is inputs, "the output embedding is no longer the input embedding"
    return full(inputs), full(outputs)


@pytest.mark.parametrize("name", architectures.TIED)
def test_a_tied_model_stays_tied_through_training(name, model_dirs, rows, tmp_path):
    worker = start_worker(model_dirs[name])  # sharded by FSDP2: still one tensor
    try:
        assert output_embedding_name(worker.model) == "lm_head.weight"
        before, _ = embeddings(worker.model)
        plan = plan_step(samples(rows), 1, minibatch_count=1, max_tokens=64)
        worker.train_step(plan.per_rank[0], plan.tokens)
        trained, _ = embeddings(worker.model)
        assert not torch.equal(trained, before)

        # published: the input embedding once; the engine (loading or receiving it) ties it
        worker.save_weights(str(tmp_path / "published"))
        written = load_file(tmp_path / "published" / "model.safetensors")
        assert "lm_head.weight" not in written
        assert torch.equal(written["model.embed_tokens.weight"], trained)
        assert sorted(worker.weight_metadata()["names"]) == sorted(written)  # a broadcast sends
        served = AutoModelForCausalLM.from_pretrained(tmp_path / "published")
        assert served.lm_head.weight is served.model.embed_tokens.weight
        swapped = AutoModelForCausalLM.from_pretrained(model_dirs[name])
        state = swapped.state_dict()
        with torch.no_grad():
            for tensor_name, tensor in read_checkpoint(tmp_path / "published").items():
                state[tensor_name].copy_(tensor)  # as the engine swaps weights in
        assert torch.equal(swapped.lm_head.weight, trained)

        # a checkpoint round trip over weights trained further keeps the tie and the values
        worker.save_checkpoint(str(tmp_path / "checkpoint"))
        worker.train_step(plan.per_rank[0], plan.tokens)
        worker.load_checkpoint(str(tmp_path / "checkpoint"))
        restored, _ = embeddings(worker.model)
        assert torch.equal(restored, trained)
    finally:
        worker.shutdown()


def test_an_attention_the_trainer_refuses_stops_the_worker_at_start(tiny_model_dir, tmp_path):
    """GPT-OSS declares windows the trainer computes, but its attention sinks (``s_aux``) it
    does not: the worker's setup refuses it, naming them."""
    config = GptOssConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=688,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    try:
        with pytest.raises(UnsupportedModel, match="'s_aux'"):
            start_worker(tmp_path)
    finally:
        if dist.is_initialized():  # the refused setup had joined its process group
            dist.destroy_process_group()
