"""The slot KV cache: batched decode of ragged requests equals a plain forward pass."""

from __future__ import annotations

import pytest
import torch

from server.engine.runner import ModelRunner, RunnerConfig

TOLERANCE = 1e-4  # float32 logits of a freshly initialised model are O(1)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(RunnerConfig(str(tiny_model_dir), max_slots=6))


def full_forward(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model(torch.tensor([ids])).logits[0]


def test_ragged_batch_decode_matches_full_forward(runner):
    gen = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (3, 40, 9, 17)
    ]
    for slot, ids in enumerate(seqs):
        prefill = runner.prefill(slot, ids[:-2])
        assert (prefill[-1] - full_forward(runner, ids[:-2])[-1]).abs().max() < TOLERANCE
    # Two decode steps for the whole ragged batch.
    for back in (2, 1):
        logits = runner.decode([s[-back] for s in seqs], [len(s) - back for s in seqs])
        for row, ids in enumerate(seqs):
            expected = full_forward(runner, ids[: len(ids) - back + 1])[-1]
            assert (logits[row] - expected).abs().max() < TOLERANCE


def test_prefill_with_all_logits(runner):
    ids = list(range(5, 25))
    chunks: list[tuple[int, torch.Tensor]] = []
    last = runner.prefill(0, ids, on_logits=lambda start, logits: chunks.append((start, logits)))
    assert [start for start, _ in chunks] == [0]
    logits = torch.cat([chunk for _, chunk in chunks])
    assert (logits - full_forward(runner, ids)).abs().max() < TOLERANCE
    assert torch.equal(last, logits[-1:])


def test_moving_a_slot_keeps_its_decode(runner):
    ids = list(range(30, 52))
    runner.prefill(4, ids[:-1])
    runner.cache.move(4, 0, len(ids) - 1)
    logits = runner.decode([ids[-1]], [len(ids) - 1])
    assert (logits[0] - full_forward(runner, ids)[-1]).abs().max() < TOLERANCE


def test_capacity_grows_and_is_bounded(tiny_model_dir):
    runner = ModelRunner(RunnerConfig(str(tiny_model_dir), max_slots=2, context_length=600))
    start = runner.cache.capacity
    ids = list(range(300)) * 2
    runner.prefill(0, ids[:520])  # decode runs slots 0..B-1
    assert start < runner.cache.capacity <= 600
    logits = runner.decode([ids[520]], [520])
    assert (logits[0] - full_forward(runner, ids[:521])[-1]).abs().max() < TOLERANCE
    with pytest.raises(ValueError, match="exceed the KV capacity"):
        runner.cache.reserve(601)


def _family_model(tmp_path, kind: str):
    """A tiny random model of another Llama-family architecture (biases, q/k norms)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    shape = dict(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = (Qwen2Config if kind == "qwen2" else Qwen3Config)(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fast_decode_matches_the_hugging_face_path(kind, tiny_model_dir, tmp_path):
    from server.engine.fast_decode import supports

    directory = tiny_model_dir if kind == "llama" else _family_model(tmp_path, kind)
    fast = ModelRunner(RunnerConfig(str(directory), max_slots=4))
    slow = ModelRunner(RunnerConfig(str(directory), max_slots=4, fast_decode=False))
    assert fast.fast is not None and slow.fast is None and supports(fast.model)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in (4, 30, 11)]
    for runner in (fast, slow):
        for slot, ids in enumerate(seqs):
            runner.prefill(slot, ids[:-3])
    for back in (3, 2, 1):  # three steps; each writes the cache the next one reads
        tokens, positions = [s[-back] for s in seqs], [len(s) - back for s in seqs]
        a, b = fast.decode(tokens, positions), slow.decode(tokens, positions)
        assert (a - b).abs().max() < TOLERANCE
    for row, ids in enumerate(seqs):
        assert (a[row] - full_forward(fast, ids)[-1]).abs().max() < TOLERANCE


def test_fast_decode_follows_weight_updates(tiny_model_dir):
    runner = ModelRunner(RunnerConfig(str(tiny_model_dir), max_slots=2))
    ids = list(range(10, 30))
    new_norm = torch.full_like(runner.model.model.norm.weight, 0.5)
    runner.load_weights({"model.norm.weight": new_norm})
    runner.prefill(0, ids[:-1])
    logits = runner.decode([ids[-1]], [len(ids) - 1])
    assert (logits[0] - full_forward(runner, ids)[-1]).abs().max() < TOLERANCE
    layer = runner.model.model.layers[0].self_attn.q_proj.weight
    runner.load_weights({"model.layers.0.self_attn.q_proj.weight": layer * 2})
    runner.prefill(0, ids[:-1])
    logits = runner.decode([ids[-1]], [len(ids) - 1])
    assert (logits[0] - full_forward(runner, ids)[-1]).abs().max() < TOLERANCE
