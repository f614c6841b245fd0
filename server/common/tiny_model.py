"""Create proxrl's tiny model: a locally trained tokenizer and a random Llama-architecture LM
(or Mistral, the same with a sliding attention window on every layer).

No model hub is reachable where proxrl is developed and tested, so the project makes its own
model. The result is an ordinary Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``chat_template.jinja``, ...) that loads with
``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` and nothing else,
so every part of proxrl treats it exactly like a real model a user brings.

This module knows nothing about serving or training; it only builds and saves the directory.
Everything it builds is deterministic: the same size gives the same files, byte for byte.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Tool markup is kept in decoded text (not "special"), as in Qwen2.5, so a tool-call parser sees it.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# A reasoning model's markers: added tokens kept in decoded text, as Qwen3 has them.
THINK_TOKENS = ["<think>", "</think>"]
VOCAB_SIZE = 1024
SEED = 1234

# The chat templates ``proxrl model init --template`` offers: the default (Hermes/Qwen2.5-style),
# and a reasoning one (Qwen3-style: answers open with <think>...</think>; history drops it).
TEMPLATE_FILES = {"default": "chat_template.jinja", "reasoning": "chat_template_reasoning.jinja"}


def chat_template(name: str = "default") -> str:
    """The source of the chat template ``name`` (one of ``TEMPLATE_FILES``)."""
    if name not in TEMPLATE_FILES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {sorted(TEMPLATE_FILES)}")
    return resources.files("server.common").joinpath(TEMPLATE_FILES[name]).read_text()


CHAT_TEMPLATE = chat_template()


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


SIZES = {
    # ~1.8M parameters: fast enough to serve and train on two CPU cores.
    "tiny": ModelSize(192, 512, 4, 6, 2, 2048),
    # ~13M parameters: a sturdier stand-in when a run can afford it.
    "small": ModelSize(384, 1024, 8, 6, 2, 4096),
}

# The context lengths ``proxrl model init --context`` accepts. The tiny models use the default RoPE,
# which has no trained length: a longer context only raises the limit the engine and the tokenizer
# enforce (memory grows with it: the KV cache, linearly, and each prompt's prefill).
MIN_CONTEXT = 128
MAX_CONTEXT = 1 << 20


def check_context(context: int) -> int:
    """``context`` if it is a context length a tiny model can have, else ValueError."""
    if not MIN_CONTEXT <= context <= MAX_CONTEXT:
        raise ValueError(f"context {context} is not between {MIN_CONTEXT} and {MAX_CONTEXT}")
    return context


_WORDS = (
    "the a an and or but if then so of to in on at for with from by as is are was were be "
    "it this that these those you your we our they their he she his her i me my what which "
    "who when where why how answer question result number sum product difference total "
    "please compute calculate tell give think step first next finally use tool call value "
    "add plus minus times divided equals yes no maybe true false ok sure here there one two "
    "three four five six seven eight nine ten hello thanks assistant user system model "
    "calculator expression arguments name function weather city search query error done"
).split()
_PUNCTUATION = [".", ",", "?", "!", ":", ";", "'", '"', "(", ")", "\n", "\n\n"]


def _training_corpus(rng: random.Random, lines: int = 6000) -> list[str]:
    """Synthetic text shaped like what the tiny model will see: chat, arithmetic, tool JSON."""
    corpus = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.45:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
            words[0] = words[0].capitalize()
            corpus.append(" ".join(words) + rng.choice(_PUNCTUATION))
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            corpus.append(f"What is {a} {op} {b}? The answer is {value}.")
        else:
            expr = f"{rng.randint(0, 99)} {rng.choice('+-*/')} {rng.randint(1, 99)}"
            corpus.append(
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                + expr
                + '"}}\n</tool_call>'
            )
    return corpus


def build_tokenizer(vocab_size: int = VOCAB_SIZE, reasoning: bool = False) -> Tokenizer:
    """A byte-level BPE (every string encodes) with digits split one by one; ``reasoning`` adds
    ``<think>`` and ``</think>`` as tokens of their own."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(random.Random(SEED)), trainer=trainer)
    tokenizer.add_tokens(MARKUP_TOKENS + (THINK_TOKENS if reasoning else []))
    return tokenizer


def create_tiny_model(
    out_dir: str | Path,
    size: str = "tiny",
    template: str = "default",
    context: int | None = None,
    window: int | None = None,
) -> Path:
    """Build the tokenizer and model of ``size`` and save them as a Hugging Face directory, with
    the chat template ``template`` (the reasoning one brings ``<think>`` tokens along) and
    ``context`` positions (None: the size's own, 2,048 or 4,096).

    ``window``: a Mistral model whose every layer attends to the last ``window`` tokens only,
    so its next token depends on the last ``num_hidden_layers * window`` tokens of a prompt
    however long (None: Llama, full attention)."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
    )

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    source = chat_template(template)
    shape = SIZES[size]
    if context is not None:
        shape = replace(shape, max_position_embeddings=check_context(context))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(reasoning=template == "reasoning"),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        model_max_length=shape.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = source
    hf_tokenizer.save_pretrained(out)

    eos_id, pad_id = hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id
    architecture = dict(
        vocab_size=len(hf_tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config = (
        LlamaConfig(**architecture)
        if window is None
        else MistralConfig(**architecture, sliding_window=window)
    )
    # Pin the neutral tokenizer class so AutoTokenizer keeps the pipeline saved in
    # tokenizer.json. (Llama, not Qwen2: transformers 5 overrides a pinned class for qwen2
    # and builds Qwen2's regex pre-tokenizer and NFC normalizer instead.)
    config.tokenizer_class = "TokenizersBackend"
    torch.manual_seed(SEED)
    model = (
        LlamaForCausalLM(config) if isinstance(config, LlamaConfig) else MistralForCausalLM(config)
    )
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True
    )
    model.save_pretrained(out)
    return out


def set_context(model_dir: str | Path, context: int) -> None:
    """Give the model in ``model_dir`` ``context`` positions: ``max_position_embeddings`` in its
    config and ``model_max_length`` in its tokenizer's (the weights stay as they are)."""
    check_context(context)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = Path(model_dir) / name
        settings = json.loads(path.read_text())
        settings[key] = context
        path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def parameter_count(model_dir: str | Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())
