"""Attention over packed rows, one row at a time: no ``[T, T]`` mask.

A packed micro-batch is one ``[1, T]`` sequence of rows laid end to end. The projections, the
MLPs and the norms run over all T tokens at once (that is what packing buys), but attention
must keep the rows apart. A block-causal ``[T, T]`` mask does it at O(T²) for the whole
micro-batch; this attention instead attends within each row's own slice (the sum of the
squared row lengths), the varlen scheme flash-attention uses on GPUs, written for any device.

Each layer computes the attention its checkpoint declares, read from the config
(``server.common.architecture.layer_windows``, the same table the engine reads):

- **Full causal** rows, and windowed rows no longer than their window: causal SDPA on the row.
- **Sliding window** ``w`` (a query at ``q`` sees keys ``q - w < k <= q``), a row of length
  ``L`` longer than ``w``: below ``4w``, SDPA on the row with a banded ``[L, L]`` boolean mask
  (it computes every query-key pair, so it costs 1.4-2.5x a causal row, whose kernel skips the
  upper triangle); from ``4w`` on, block by block: each ``w`` queries attend to the ``2w - 1``
  keys their band reaches, O(L·w) instead of O(L²). Measured on 2 CPU cores, forward and
  backward, 8 heads of 64: ``L=2048, w=512``: causal 0.40 s, band 0.56 s, blocks 0.71 s;
  ``L=4096, w=512``: 1.06, 2.49, 1.69 s; ``L=8192, w=1024``: 5.4, 10.9, 2.9 s.
- **Logit soft-capping** ``c`` (Gemma2: scores ``c * tanh(s / c)`` before the mask): scores
  computed explicitly per row (``q·kᵀ * scale``, cap, mask, softmax in float32, ``·v``), as
  transformers' eager attention does. Cost: ``heads * L²`` floats per row, three times, where
  SDPA keeps O(L); under autograd each row runs under activation checkpointing, so only
  q, k, v are kept for the backward and the scores are computed again there (one extra
  attention forward for a capped layer, and the peak is one row's scores, not every layer's).

It is a transformers attention function: ``register()`` adds it under ``NAME``, a model loaded
with ``attn_implementation=NAME`` uses it, and the forward gets the row boundaries as the
keyword ``cu_seq_lens_q`` (``[0, len0, len0 + len1, ..., T]``), which transformers hands down
to every attention call; it then builds no attention mask at all. An attention keyword that
would change the math and is not computed here (attention sinks ``s_aux``, position biases,
sparse indices, bidirectional attention) is refused with its name, never ignored. It knows
nothing of PPO.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from server.common.architecture import layer_windows, visible

__all__ = ["NAME", "packed_attention", "register"]

NAME = "proxrl_packed"

# Keywords transformers passes down that do not change what attention computes.
INERT = frozenset(
    {
        "cu_seq_lens_k",  # checked equal to cu_seq_lens_q: no cache, keys are the queries' rows
        "max_length_q",
        "max_length_k",
        "position_ids",  # already applied by the rotary embedding
        "use_cache",
        "output_attentions",  # attention weights are never returned (None)
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
    }
)
HANDLED = frozenset({"cu_seq_lens_q", "sliding_window", "softcap", "is_causal"})
# A windowed row this many windows long or longer attends block by block (see the docstring).
BLOCKED_FROM = 4


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row, with the layer's window and soft-cap.
    ``query`` is ``[1, heads, T, dim]``, ``key`` and ``value`` ``[1, kv_heads, T, dim]``;
    returns ``[1, T, heads, dim]`` as transformers expects of an attention function."""
    bounds = kwargs.get("cu_seq_lens_q")
    if not isinstance(bounds, torch.Tensor):
        raise ValueError(f"{NAME} attention needs the row boundaries as cu_seq_lens_q")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{NAME} attention takes one packed sequence and no attention mask")
    _refuse_unknown(module, bounds, kwargs)
    window = _window(module, kwargs)
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    rows = [
        _row(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], window, softcap, scale, dropout)
        for s, e in itertools.pairwise(bounds.tolist())
        if e > s
    ]
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def _refuse_unknown(module: torch.nn.Module, bounds: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Raise on any keyword that would make this attention compute another model."""
    for name, value in kwargs.items():
        if name in HANDLED or name in INERT or value is None:
            continue
        raise ValueError(
            f"{NAME} attention does not implement the attention keyword {name!r} that "
            f"{type(module).__name__} passes; training would compute another model"
        )
    keys = kwargs.get("cu_seq_lens_k")
    if isinstance(keys, torch.Tensor) and not torch.equal(keys.to(bounds.device), bounds):
        raise ValueError(f"{NAME} attention: cu_seq_lens_k differs from cu_seq_lens_q (a cache?)")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"{NAME} attention is causal; {type(module).__name__} is not (is_causal)")
    softcap = kwargs.get("softcap")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{NAME} attention: softcap must be positive, got {softcap!r}")


def _window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The layer's sliding window from its config; a ``sliding_window`` keyword must agree."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or not isinstance(index, int):
        raise ValueError(
            f"{NAME} attention reads each layer's window from module.config and "
            f"module.layer_idx; {type(module).__name__} has no "
            f"{'config' if config is None else 'layer_idx'}"
        )
    window = layer_windows(config)[index]
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise ValueError(
            f"{NAME} attention: layer {index} of {type(module).__name__} passes "
            f"sliding_window={kwargs['sliding_window']!r} but its config declares {window!r}"
        )
    return window


def _row(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    softcap: float | None,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """One row's attention, ``[1, heads, L, dim]``."""
    length = query.shape[2]
    if window is not None and length <= window:
        window = None  # a row inside its window sees everything before it
    if softcap is not None:
        if torch.is_grad_enabled():
            return checkpoint(
                _capped, query, key, value, window, softcap, scale, dropout, use_reentrant=False
            )
        return _capped(query, key, value, window, softcap, scale, dropout)
    if window is None:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale
        )
    if length < BLOCKED_FROM * window:
        band = _band(range(length), range(length), window, query.device)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=band, dropout_p=dropout, scale=scale
        )
    return _blocked(query, key, value, window, scale, dropout)


def _blocked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Sliding-window attention of a long row: each block of ``window`` queries attends to the
    keys its band can reach (the block itself and the ``window - 1`` keys before it)."""
    length = query.shape[2]
    blocks = []
    for start in range(0, length, window):
        end, first = min(start + window, length), max(0, start - window + 1)
        band = _band(range(start, end), range(first, end), window, query.device)
        blocks.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, first:end],
                value[:, :, first:end],
                attn_mask=band,
                dropout_p=dropout,
                scale=scale,
            )
        )
    return torch.cat(blocks, dim=2)


def _band(queries: range, keys: range, window: int | None, device: torch.device) -> torch.Tensor:
    """``[len(queries), len(keys)]``, True where the query at position ``q`` sees the key at
    ``k``: ``q - window < k <= q`` (``k <= q`` without a window)."""
    return visible(
        torch.arange(queries.start, queries.stop, device=device)[:, None],
        torch.arange(keys.start, keys.stop, device=device)[None, :],
        window,
    )


def _capped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    softcap: float,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """Soft-capped attention of one row, computed as transformers' eager attention does."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    length = query.shape[2]
    visible = _band(range(length), range(length), window, query.device)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value)


def register() -> None:
    """Make ``attn_implementation=NAME`` available to transformers (idempotent)."""
    AttentionInterface.register(NAME, packed_attention)
