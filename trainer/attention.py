"""Attention over packed rows, one row at a time: no ``[T, T]`` mask.

A packed micro-batch is one ``[1, T]`` sequence of rows laid end to end. The projections, the
MLPs and the norms run over all T tokens at once (that is what packing buys), but attention
must keep the rows apart. A block-causal ``[T, T]`` mask does it at O(T²) for the whole
micro-batch; this attention instead runs causal SDPA on each row's own slice (the sum of the
squared row lengths), the varlen scheme flash-attention uses on GPUs, written for any device.

It is a transformers attention function: ``register()`` adds it under ``NAME``, a model loaded
with ``attn_implementation=NAME`` uses it, and the forward gets the row boundaries as the
keyword ``cu_seq_lens_q`` (``[0, len0, len0 + len1, ..., T]``), which transformers hands down
to every attention call; it then builds no attention mask at all. It knows nothing of PPO.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

__all__ = ["NAME", "packed_attention", "register"]

NAME = "proxrl_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row. ``query`` is ``[1, heads, T, dim]``, ``key``
    and ``value`` ``[1, kv_heads, T, dim]``; returns ``[1, T, heads, dim]`` as transformers
    expects of an attention function."""
    bounds = kwargs.get("cu_seq_lens_q")
    if not isinstance(bounds, torch.Tensor):
        raise ValueError(f"{NAME} attention needs the row boundaries as cu_seq_lens_q")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{NAME} attention takes one packed sequence and no attention mask")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    edges = bounds.tolist()
    rows = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
        )
        for start, end in itertools.pairwise(edges)
        if end > start
    ]
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation=NAME`` available to transformers (idempotent)."""
    AttentionInterface.register(NAME, packed_attention)
