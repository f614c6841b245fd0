"""The model runner: loads a Hugging Face causal LM and runs prefill and batched decode on it.

The model and tokenizer come from the ordinary ``AutoModelForCausalLM`` / ``AutoTokenizer`` path,
so proxrl's tiny model and a user's own model directory load the same way. Attention runs over a
:class:`SlotKVCache`, which lets requests of different lengths decode together. This module
knows nothing about requests, sampling or HTTP; it maps token ids to logits and holds the weights.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from server.common import architecture
from server.common.cache_argument import cache_keyword
from server.engine import fast_decode
from server.engine.kv_cache import SlotKVCache
from server.engine.lora import Adapter, AdapterBank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    max_slots: int = 64
    context_length: int | None = None  # None: the model's max_position_embeddings
    fast_decode: bool = True  # Llama-family models decode through FastDecoder
    prefill_chunk: int = 512  # prompt tokens per prefill forward
    max_loaded_loras: int = 8  # LoRA adapters held at once


class PrefillCancelled(Exception):
    """A prefill stopped between two chunks because its caller asked (the engine stopping)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.model = self._load_model(config.model_path)
        model_config = self.model.config
        self.context_length = config.context_length or model_config.max_position_embeddings
        self.vocab_size = model_config.vocab_size
        head_dim = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        self.cache = SlotKVCache(
            num_layers=model_config.num_hidden_layers,
            num_kv_heads=getattr(model_config, "num_key_value_heads", None)
            or model_config.num_attention_heads,
            head_dim=head_dim,
            max_slots=config.max_slots,
            max_capacity=self.context_length,
            dtype=self.dtype,
            device=self.device,
        )
        self.windows = architecture.layer_windows(model_config)
        self.mask_mapping = architecture.uses_mask_mapping(model_config)
        self.cache_keyword = cache_keyword(self.model)  # `cache` from transformers 5.24
        self.adapters = AdapterBank(self.model, config.max_loaded_loras)
        self.fast = (
            fast_decode.FastDecoder(self.model, self.adapters)
            if config.fast_decode and fast_decode.supports(self.model)
            else None
        )

    def _load_model(self, path: str) -> PreTrainedModel:
        architecture.check_supported(AutoConfig.from_pretrained(path), path)
        # The engine hands every layer a float mask it built itself (0 where a key is visible,
        # the dtype's minimum where not), which SDPA and eager attention both apply by adding
        # it to the scores; flash/flex implementations would not take it. Models without SDPA
        # (Gemma2: its soft-cap) run eager, which honours their soft-cap.
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation="sdpa"
            )
        except ValueError:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation="eager"
            )
        model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers stub
        model.requires_grad_(False)
        log.info("loaded %s (%s parameters)", path, sum(p.numel() for p in model.parameters()))
        return model

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.model.config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ----- forward passes ------------------------------------------------------------------

    def _masks(
        self, positions: torch.Tensor, kv_len: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive attention masks ``[B, 1, Q, kv_len]`` for queries at ``positions`` ``[B, Q]``
        over cache positions ``0..kv_len-1``: a key is visible when it is not after the query
        and, on a sliding layer, less than the window behind it. One mask per layer type for
        models that take a mapping, else the one mask every layer shares."""
        keys = torch.arange(kv_len, device=self.device)
        query = positions[:, None, :, None]
        open_ = torch.zeros((), dtype=self.dtype, device=self.device)
        blocked = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)

        def mask(window: int | None) -> torch.Tensor:
            return torch.where(architecture.visible(query, keys, window), open_, blocked)

        if self.mask_mapping:
            window = next(w for w in self.windows if w is not None)
            return {architecture.FULL: mask(None), architecture.SLIDING: mask(window)}
        return mask(self.windows[0])

    @torch.inference_mode()
    def prefill(
        self,
        slot: int,
        token_ids: list[int],
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        start: int = 0,
        adapter: Adapter | None = None,
    ) -> torch.Tensor:
        """Fill ``slot`` with ``token_ids`` from position ``start`` (the slot holds the KV of the
        tokens before it: a cached prefix); the last token's logits ``[1, V]``.

        The prompt goes through the model ``prefill_chunk`` tokens at a time, each chunk
        attending (causally) to the cache so far and itself: a chunk's mask and scores are
        ``chunk x length``, never ``length x length``, so memory grows with the prompt's KV
        cache, linearly. ``on_logits(start, logits)`` gets each chunk's logits of every token,
        ``[n, V]`` for positions ``start...`` (prompt logprobs are taken from them chunk by
        chunk); ``cancelled()``, asked before each chunk, stops the prefill (PrefillCancelled).
        With ``adapter``, its LoRA deltas are added to the base model's."""
        length = len(token_ids)
        if start < 0 or (start and start >= length):  # one token at least gives the logits
            raise ValueError(f"a prefill of {length} tokens cannot start at {start}")
        self.cache.reserve(length, slot + 1)  # grown once, not chunk by chunk
        chunk = max(1, self.config.prefill_chunk)
        last = torch.empty(0)
        with self.adapters.batch([adapter], self.device):
            for begin in range(start, length, chunk):
                last = self._prefill_chunk(slot, token_ids, begin, chunk, on_logits, cancelled)
        return last  # [1, V]

    def _prefill_chunk(
        self,
        slot: int,
        token_ids: list[int],
        begin: int,
        chunk: int,
        on_logits: Callable[[int, torch.Tensor], None] | None,
        cancelled: Callable[[], bool] | None,
    ) -> torch.Tensor:
        """One chunk of ``prefill`` from ``begin``; the last token's logits ``[1, V]``."""
        length = len(token_ids)
        if cancelled is not None and cancelled():
            raise PrefillCancelled(f"prefill stopped at token {begin} of {length}")
        end = min(begin + chunk, length)
        self.cache.plan_prefill(slot, begin, end - begin)
        ids = torch.tensor([token_ids[begin:end]], device=self.device)
        positions = torch.arange(begin, end, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self._masks(positions, end),
            **{self.cache_keyword: self.cache},
            use_cache=True,
            logits_to_keep=0 if on_logits is not None else 1,
        )
        if on_logits is not None:
            on_logits(begin, out.logits[0])
        return out.logits[0, -1:]

    @torch.inference_mode()
    def decode(
        self,
        last_tokens: list[int],
        positions: list[int],
        adapters: list[Adapter | None] | None = None,
    ) -> torch.Tensor:
        """One step for slots ``0..B-1``: row b feeds ``last_tokens[b]`` at ``positions[b]``,
        through the base model plus ``adapters[b]`` (None: the base alone)."""
        with self.adapters.batch(adapters or [], self.device):
            return self._decode(last_tokens, positions)

    def _decode(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor:
        tokens = torch.tensor(last_tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        if self.fast is not None:
            return self.fast.decode(tokens, pos, self.cache)
        self.cache.plan_decode(len(last_tokens), pos)
        out = self.model(
            input_ids=tokens.unsqueeze(1),
            position_ids=pos.unsqueeze(1),
            attention_mask=self._masks(pos.unsqueeze(1), self.cache.get_seq_length()),
            **{self.cache_keyword: self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]  # [B, V]

    # ----- weights -------------------------------------------------------------------------

    def check_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless every tensor names a parameter of the same shape."""
        state = self.model.state_dict()
        unknown = sorted(set(named_tensors) - set(state))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}")
        for name, tensor in named_tensors.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: model {tuple(state[name].shape)}, "
                    f"got {tuple(tensor.shape)}"
                )

    def model_named(self, named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors under the model's own parameter names.

        Trainers publish under the checkpoint format's names (what ``save_pretrained`` writes
        and SGLang loads). transformers 5 renames or fuses some of them when it loads a model
        (GPT-NeoX's ``embed_out`` is ``lm_head``; a MoE layer's experts, one tensor each in the
        checkpoint, are one stacked tensor in memory), so names the model does not have go
        through transformers' own loading conversion: the tensors are written to a temporary
        directory and loaded into a second model on the CPU (a copy of the model in memory and on
        disk per update; the embedded engine's models are small, and SGLang takes these names
        itself). Names it has are taken as they are, with no copy."""
        names = set(named_tensors)
        if names <= set(self.model.state_dict()):
            return named_tensors
        unknown = sorted(names - self._checkpoint_names())
        if unknown:  # refused before any work: a bad request costs no model load
            raise ValueError(f"unknown parameter names: {unknown[:5]}")
        try:
            with tempfile.TemporaryDirectory(prefix="proxrl-weights-") as tmp:
                tensors = {n: t.detach().contiguous().cpu() for n, t in named_tensors.items()}
                save_file(tensors, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
                self.model.config.save_pretrained(tmp)
                loaded: Any = AutoModelForCausalLM.from_pretrained(
                    tmp, dtype=self.dtype, output_loading_info=True
                )
        except Exception as exc:  # e.g. a stacked tensor given only some of its experts
            raise ValueError(f"cannot map the checkpoint names to the model's: {exc}") from exc
        converted, info = loaded
        if info["unexpected_keys"]:
            raise ValueError(f"unknown parameter names: {sorted(info['unexpected_keys'])[:5]}")
        missing = set(info["missing_keys"])
        return {n: t for n, t in converted.state_dict().items() if n not in missing}

    @functools.cache  # noqa: B019  # one per runner, which lives as long as the engine
    def _checkpoint_names(self) -> frozenset[str]:
        """Every name the checkpoint format gives this model's tensors (and the model's own)."""
        from transformers.core_model_loading import revert_weight_conversion

        with torch.no_grad():
            state = self.model.state_dict()
            return frozenset(revert_weight_conversion(self.model, dict(state))) | set(state)

    @torch.inference_mode()
    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors into the model's parameters by their state-dict names (casting dtype)."""
        self.check_weights(named_tensors)
        state = self.model.state_dict()
        for name, tensor in named_tensors.items():
            state[name].copy_(tensor)
        if self.fast is not None:
            self.fast.refresh()

    def model_info(self) -> dict:
        config = self.model.config
        return {
            "model_type": config.model_type,
            "architectures": list(config.architectures or []),
            "tokenizer_path": str(Path(self.config.model_path)),
        }
