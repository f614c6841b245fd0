"""A packed forward of the tiny Llama equals separate forwards of its rows.

transformers 5 keeps packed rows apart by itself when the forward gets ``position_ids`` that
restart at 0 on every row, no ``attention_mask`` and no KV cache (``use_cache=False``): it
then builds a block-diagonal causal mask from the positions. With the cache on (the default
of configs saying ``use_cache: true``, the tiny model's included) it does not, and a row
attends to the rows packed before it. Hence ``use_cache=False`` in every forward here.

Tolerance: float32 logits, logprobs and parameter gradients within 1e-5 absolute of the
per-row forwards. Measured: logits 7e-7, logprobs 5e-7, gradients 4e-6 (largest gradient entry
about 9); with the cache left on the same comparisons are off by 1.45, 0.65 and 9.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer import attention
from trainer.batching import packed, shift_logprobs

TOL = 1e-5
LENGTHS = [7, 13, 1, 20, 5]


@pytest.fixture(scope="module")
def rows(tiny_model_dir) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def load(tiny_model_dir, attention: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=attention, dtype=torch.float32
    )
    return model.eval()


def row_logprobs(model: torch.nn.Module, row: list[int]) -> torch.Tensor:
    """One row alone: logprob of each token given the ones before it, 0 for the first."""
    ids = torch.tensor([row])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([logp.new_zeros(1), logp])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_per_row_logits(tiny_model_dir, rows, attention):
    model = load(tiny_model_dir, attention)
    batch = packed(rows)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits[0]
        separate = torch.cat(
            [model(input_ids=torch.tensor([r]), use_cache=False).logits[0] for r in rows]
        )
        logprobs = shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)
        expected = torch.cat([row_logprobs(model, row) for row in rows])
    assert (logits - separate).abs().max().item() <= TOL
    assert (logprobs - expected).abs().max().item() <= TOL


def test_packed_gradients_equal_per_row_gradients(tiny_model_dir, rows):
    model = load(tiny_model_dir, "sdpa")
    batch = packed(rows)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1))

    model.zero_grad()
    expected = torch.cat([row_logprobs(model, row) for row in rows])
    (expected * weights).sum().backward()
    per_row = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
    ).logits[0]
    (shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens) * weights).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad - per_row[name]).abs().max().item() <= TOL, name


@pytest.fixture(scope="module")
def packed_model(tiny_model_dir) -> torch.nn.Module:
    """The tiny model with the trainer's packed-row attention (``trainer/attention.py``)."""
    attention.register()
    return load(tiny_model_dir, attention.NAME)


def packed_forward(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        cu_seq_lens_q=batch.cu_seqlens,
        use_cache=False,
    ).logits[0]


def test_packed_row_attention_equals_per_row_forwards(tiny_model_dir, rows, packed_model):
    reference = load(tiny_model_dir, "sdpa")
    batch = packed(rows)
    with torch.no_grad():
        logits = packed_forward(packed_model, batch)
        separate = torch.cat(
            [reference(input_ids=torch.tensor([r]), use_cache=False).logits[0] for r in rows]
        )
    assert (logits - separate).abs().max().item() <= TOL


def test_packed_row_attention_gradients_equal_per_row_gradients(tiny_model_dir, rows, packed_model):
    reference = load(tiny_model_dir, "sdpa")
    batch = packed(rows)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(2))
    reference.zero_grad()
    expected = torch.cat([row_logprobs(reference, row) for row in rows])
    (expected * weights).sum().backward()
    packed_model.zero_grad()
    logits = packed_forward(packed_model, batch)
    (shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens) * weights).sum().backward()
    grads = dict(packed_model.named_parameters())
    for name, p in reference.named_parameters():
        assert (grads[name].grad - p.grad).abs().max().item() <= TOL, name


def test_packed_row_attention_refuses_a_forward_without_row_boundaries(packed_model, rows):
    batch = packed(rows)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
