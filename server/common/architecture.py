"""What a checkpoint's config says about its attention: which layers see how far back.

The engine builds its own attention masks (its KV cache holds requests of different lengths in
one batch, which transformers' mask builders cannot describe), and the trainer runs its own
packed attention. Both must compute the model the checkpoint declares, so both read the
attention layout from here: per layer, ``None`` for full causal attention or the sliding
window ``w`` (a query at position ``q`` sees keys ``k`` with ``q - w < k <= q``, transformers'
convention). Features neither can honour are named by ``unsupported_features`` so that the
engine and the trainer refuse such a model at start instead of computing another one.

Pure functions of a ``transformers`` config, and the visibility rule itself (``visible``) on
position tensors; this module knows nothing of caches or requests.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "UnsupportedModel",
    "check_supported",
    "layer_windows",
    "text_config",
    "unsupported_features",
    "uses_mask_mapping",
    "visible",
]

FULL = "full_attention"
SLIDING = "sliding_attention"


class UnsupportedModel(ValueError):
    """The checkpoint declares something the engine or the trainer does not compute."""


def check_supported(config: Any, where: object) -> None:
    """Refuse a model whose attention proxrl does not compute, naming every feature."""
    found = unsupported_features(config)
    if found:
        raise UnsupportedModel(
            f"proxrl cannot serve or train {where} exactly: its config declares "
            f"{', '.join(found)}, which proxrl's engine and trainer do not compute"
        )


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def unsupported_features(config: Any) -> list[str]:
    """Attention features proxrl's engine and trainer do not compute, by config key."""
    config = text_config(config)
    found = []
    for kind in sorted(set(getattr(config, "layer_types", None) or [])):
        if kind not in (FULL, SLIDING):
            found.append(f"layer_types={kind!r}")
    if getattr(config, "attention_chunk_size", None):
        found.append("attention_chunk_size (chunked attention)")
    if getattr(config, "use_bidirectional_attention", False):
        found.append("use_bidirectional_attention (not a causal LM)")
    if getattr(config, "is_encoder_decoder", False):
        found.append("is_encoder_decoder")
    if SLIDING in (getattr(config, "layer_types", None) or []) and not _window(config):
        found.append("layer_types='sliding_attention' without a sliding_window")
    return found


def _window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        return None
    return int(window) if window else None


def uses_mask_mapping(config: Any) -> bool:
    """Whether the model takes one mask per layer type (``{layer_type: mask}``).

    Models whose config lists ``layer_types`` with a sliding layer (Gemma2/3, Qwen2/3 with
    windows, gpt-oss) pick each layer's mask from such a mapping; the others (Mistral, Phi-3,
    Mixtral, Qwen3-MoE) take one mask that already carries their single window."""
    return SLIDING in (getattr(text_config(config), "layer_types", None) or [])


def layer_windows(config: Any) -> list[int | None]:
    """Per decoder layer: the sliding window, or None for full causal attention."""
    config = text_config(config)
    window = _window(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == SLIDING else None for kind in layer_types]
    return [window] * config.num_hidden_layers


def visible(query_positions: Any, key_positions: Any, window: int | None) -> Any:
    """Where a query sees a key, for position tensors that broadcast against each other: the
    key is not after the query and, with a ``window``, less than ``window`` behind it. The one
    statement of the rule, for the engine's masks and the trainer's packed attention."""
    behind = query_positions - key_positions
    seen = behind >= 0
    return seen if window is None else seen & (behind < window)
