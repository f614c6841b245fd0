"""Small random-initialised models of the architectures users bring, built without a hub.

Each entry of ``ARCHITECTURES`` is a transformers config of a real architecture at a tiny
width (2 layers, hidden 64) around proxrl's own tokenizer. ``build(name, out_dir, tokenizer_dir)``
saves it as an ordinary Hugging Face model directory (the tokenizer files copied from the tiny
model), so the engine and the trainer load it exactly as they load a user's checkpoint.

The shapes exercise what differs between architectures: attention bias and tied embeddings
(Qwen2), q/k norms (Qwen3), a sliding window on every layer (Mistral, Phi-3) or on some
(Gemma2, Gemma3), eager-only attention with logit soft-capping (Gemma2), a different module
layout (GPT-NeoX: ``gpt_neox.layers``) and a mixture of experts (Qwen3-MoE). Windows are
``WINDOW`` tokens so that test sequences cross them. ``initializer_range`` is raised from the
usual 0.02 so that attention is far from uniform and soft-caps bite: with the default a model
that ignores its window or cap differs from one that honours it by less than the tolerances.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

WINDOW = 8
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INIT = 0.1
MAX_POSITIONS = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=MAX_POSITIONS,
    initializer_range=INIT,
    bos_token_id=None,
)
_GQA = dict(num_key_value_heads=KV_HEADS)


def _llama() -> PretrainedConfig:
    return LlamaConfig(**_COMMON, **_GQA, tie_word_embeddings=False)


def _qwen2() -> PretrainedConfig:  # q/k/v bias; tied like Qwen2.5-0.5B
    return Qwen2Config(**_COMMON, **_GQA, tie_word_embeddings=True)


def _qwen3() -> PretrainedConfig:  # q/k RMSNorm, explicit head_dim, tied like Qwen3-0.6B
    return Qwen3Config(**_COMMON, **_GQA, head_dim=HEAD_DIM, tie_word_embeddings=True)


def _mistral() -> PretrainedConfig:  # Mistral-7B-v0.1: one window on every layer
    return MistralConfig(**_COMMON, **_GQA, sliding_window=WINDOW, tie_word_embeddings=False)


def _gemma2() -> PretrainedConfig:  # eager only: soft-capped attention, sliding then global
    return Gemma2Config(
        **_COMMON,
        **_GQA,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "full_attention"],
    )


def _gemma3() -> PretrainedConfig:  # text-only Gemma3: local layers with their own RoPE base
    return Gemma3TextConfig(
        **_COMMON,
        **_GQA,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def _phi3() -> PretrainedConfig:  # fused qkv and gate/up projections, a window on every layer
    return Phi3Config(**_COMMON, **_GQA, sliding_window=WINDOW, pad_token_id=0)


def _gpt_neox() -> PretrainedConfig:  # gpt_neox.layers, partial rotary, parallel residual
    common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
    return GPTNeoXConfig(
        **common, intermediate_size=128, rotary_pct=0.25, tie_word_embeddings=False
    )


def _qwen3_moe() -> PretrainedConfig:  # 4 experts, 2 per token, on every layer
    return Qwen3MoeConfig(
        **_COMMON,
        **_GQA,
        head_dim=HEAD_DIM,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )


ARCHITECTURES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt_neox": _gpt_neox,
    "qwen3_moe": _qwen3_moe,
}
TIED = ("qwen2", "qwen3", "gemma2", "gemma3")
WINDOWED = ("mistral", "gemma2", "gemma3", "phi3")


def build(name: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """Save a random ``name`` model with the tokenizer of ``tokenizer_dir`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / file).exists():
            shutil.copy(Path(tokenizer_dir) / file, out / file)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = ARCHITECTURES[name]()
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.tokenizer_class = "TokenizersBackend"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
    )
    model.save_pretrained(out)
    return out


def reference_logprobs(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """A float64 teacher-forced forward with the model's own attention and masks: the logprob
    of each token after the first given those before it."""
    # Experts run one by one ("eager"): the grouped matmul of MoE layers has no float64 kernel.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    target = torch.tensor(ids[1:])
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, target[:, None])[:, 0]
