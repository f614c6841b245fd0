"""Padding-free packing of rows into tensors, and back to per-token logprobs and entropies.

`packed` concatenates the rows of one micro-batch (which rows: ``trainer/plan.py``, on row
lengths alone) into a single ``[1, T]`` sequence whose ``position_ids`` restart at 0 on every
row, so an attention implementation that honours them (transformers does, for a forward without
attention mask and without KV cache) keeps rows apart, and no compute is spent on padding.
`padded` builds the padded ``[B, L]`` equivalent, for benchmarks to compare against.

Alignment, as the store writes it: in a row, ``logprobs[i]``, ``loss_mask[i]`` and
``versions[i]`` describe token ``input_ids[i]`` given the tokens before it; position 0 of a row
is a prompt token (mask 0). The model's logits at position ``i`` predict token ``i + 1``;
`shift_logprobs` undoes that shift, so every per-token array lines up with ``input_ids``;
`shift_entropy` does the same for the entropy of each next-token distribution.

This module knows nothing about models, losses or workers: it moves indices and tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainer.plan import check_lengths


@dataclass(frozen=True)
class PackedBatch:
    """Rows concatenated into one sequence, with per-token fields aligned to ``input_ids``.

    ``input_ids`` and ``position_ids`` are ``[1, T]`` long (positions restart at 0 on every
    row); ``sequence_ids`` is ``[T]`` long, the row of each token; ``cu_seqlens`` is ``[R + 1]``
    int32, the row boundaries (flash-attention's convention). ``per_token`` holds the caller's
    fields, each ``[T]``, describing token ``i`` given the tokens before it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_rows(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.per_token[name]


def _concat_field(
    name: str, values: Sequence[Sequence[float | int]], lengths: list[int]
) -> torch.Tensor:
    if len(values) != len(lengths):
        raise ValueError(f"{name} has {len(values)} rows, expected {len(lengths)}")
    parts = [torch.as_tensor(row) for row in values]
    for r, (part, length) in enumerate(zip(parts, lengths, strict=True)):
        if part.shape != (length,):
            raise ValueError(f"{name}[{r}] has shape {tuple(part.shape)}, expected ({length},)")
    return torch.cat(parts)


def packed(
    rows: Sequence[Sequence[int]], **per_token: Sequence[Sequence[float | int]]
) -> PackedBatch:
    """Concatenate ``rows`` (token ids) and each per-token field into a `PackedBatch`.

    Field dtypes follow ``torch.as_tensor``: Python floats give float32, ints give int64,
    tensors keep theirs.
    """
    if not rows:
        raise ValueError("nothing to pack: no rows")
    lengths = [len(row) for row in rows]
    check_lengths(lengths)
    input_ids = torch.cat([torch.as_tensor(row, dtype=torch.long) for row in rows])
    position_ids = torch.cat([torch.arange(length) for length in lengths])
    sequence_ids = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    cu_seqlens = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    fields = {name: _concat_field(name, values, lengths) for name, values in per_token.items()}
    return PackedBatch(input_ids[None], position_ids[None], sequence_ids, cu_seqlens, fields)


@dataclass(frozen=True)
class PaddedBatch:
    """Rows right-padded to the longest: ``input_ids`` and ``attention_mask`` are ``[B, L]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def padded(rows: Sequence[Sequence[int]], pad_id: int) -> PaddedBatch:
    """The padding baseline: rows right-padded with ``pad_id``, mask 1 on real tokens."""
    if not rows:
        raise ValueError("nothing to pad: no rows")
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[r, : len(row)] = 1
    return PaddedBatch(input_ids, attention_mask)


def _row_starts(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if cu_seqlens.ndim != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must be 1-D, start at 0 and end at the token count {num_tokens}"
        )
    starts = torch.zeros(num_tokens, dtype=torch.bool, device=cu_seqlens.device)
    starts[cu_seqlens[:-1].long()] = True
    return starts


def shift_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """For each packed position i, log p(input_ids[i] | earlier tokens of its row); 0 at row starts.

    ``logits`` is ``[T, V]`` (log-softmaxed values work too), ``input_ids`` ``[T]``. The value
    at i comes from ``logits[i - 1]``; at a row's first position that would be the previous
    row's last logits, so the result there is 0 and no gradient reaches those logits.

    Memory: the logprob is ``logit[token] - logsumexp(logits)``, so autograd keeps only the
    logits themselves, not a ``[T, V]`` log-softmax. Half-precision logits are upcast to
    float32 (that copy is the one ``[T, V]`` allocation); float32 and float64 are used as is.
    """
    if logits.ndim != 2 or input_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and input_ids [T], got {tuple(logits.shape)} "
            f"and {tuple(input_ids.shape)}"
        )
    num_tokens = logits.shape[0]
    starts = _row_starts(cu_seqlens, num_tokens)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    previous = logits[:-1]
    chosen = previous.gather(-1, input_ids[1:, None].long()).squeeze(-1)
    shifted = chosen - torch.logsumexp(previous, dim=-1)
    shifted = torch.cat([shifted.new_zeros(min(1, num_tokens)), shifted])
    return torch.where(starts, torch.zeros_like(shifted), shifted)


ENTROPY_CHUNK = 1024  # positions per chunk: bounds shift_entropy's temporaries to [1024, V]


@torch.no_grad()
def shift_entropy(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """For each packed position i, the entropy (nats) of the distribution that predicted token
    i, softmax(``logits[i - 1]``); 0 at row starts, as in `shift_logprobs`.

    ``logits`` is ``[T, V]``, already divided by any sampling temperature. A statistic, not a
    loss term: computed without gradient, a chunk of positions at a time, so it never holds
    more than a ``[ENTROPY_CHUNK, V]`` temporary. Float32 for half-precision inputs.
    """
    if logits.ndim != 2:
        raise ValueError(f"expected logits [T, V], got {tuple(logits.shape)}")
    num_tokens = logits.shape[0]
    starts = _row_starts(cu_seqlens, num_tokens)
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    out = torch.zeros(num_tokens, dtype=dtype, device=logits.device)
    for begin in range(0, num_tokens - 1, ENTROPY_CHUNK):
        chunk = logits[begin : min(begin + ENTROPY_CHUNK, num_tokens - 1)].to(dtype)
        # entr(p) = -p log p, and 0 where p = 0 (a logit of -inf), where p * log p is nan
        entropy = torch.special.entr(torch.softmax(chunk, dim=-1)).sum(-1)
        out[begin + 1 : begin + 1 + chunk.shape[0]] = entropy
    return out.masked_fill(starts, 0.0)


def shift_entropy_with_grad(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`shift_entropy`, differentiable: for an entropy bonus in the loss. Keeps the ``[T, V]``
    log-softmax for the backward (the price of the bonus; `shift_entropy` keeps nothing).
    A zero probability (a logit of -inf) contributes 0 and sends no NaN back."""
    if logits.ndim != 2:
        raise ValueError(f"expected logits [T, V], got {tuple(logits.shape)}")
    num_tokens = logits.shape[0]
    starts = _row_starts(cu_seqlens, num_tokens)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    # p log p with log p floored at the dtype's lowest: 0 * finite where p = 0, so no 0 * inf
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    shifted = torch.cat([entropy.new_zeros(min(1, num_tokens)), entropy])
    return torch.where(starts, torch.zeros_like(shifted), shifted)
