"""A supervised warm-up: the tiny model, fine-tuned on (messages, answer) pairs until it can do
a task a little, so that reinforcement learning has something to improve.

The prompt of each example is rendered with the tokenizer's chat template and encoded exactly
as the proxy does (``add_generation_prompt=True``, then the text encoded without added special
tokens), so a prompt seen here is, token for token, the prompt the proxy sends the engine. The
loss falls on the answer's tokens and the end-of-turn token after them, nowhere else.

``sample_completions`` samples from a model directory the way the engine does (the full softmax
at a temperature, no top-k or top-p), to measure what an agent would see. ``cached_warm_start``
keeps warmed-up models under a key of everything that shapes them, so a demo pays once.

This module knows nothing about the task (examples arrive as data), the proxy or RL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from server.common.cache_argument import cache_keyword

__all__ = [
    "Example",
    "cached_warm_start",
    "encode_example",
    "prompt_ids",
    "sample_completions",
    "warm_start",
]

log = logging.getLogger("proxrl.warmup")

Example = tuple[list[dict[str, Any]], str]  # (chat messages, the assistant's answer text)
OnStep = Callable[[int, int, float], None]  # (steps done, steps, the last step's loss)
IGNORE = -100  # label of tokens without loss
MARKER = "warmup.json"  # written last: a cache entry without it is incomplete


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The prompt the proxy builds for ``messages``: the chat template with the generation
    prompt, rendered to text, then encoded without added special tokens."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_example(tokenizer: Any, example: Example) -> tuple[list[int], list[int]]:
    """Input ids and labels of one example: the prompt (no loss), then the answer's tokens and
    the end-of-turn token (with loss), the way the engine samples them after the prompt."""
    messages, answer = example
    prompt = prompt_ids(tokenizer, messages)
    target = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    return prompt + target, [IGNORE] * len(prompt) + target


def _batch(
    encoded: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (row_ids, row_labels) in enumerate(encoded):
        ids[row, : len(row_ids)] = torch.tensor(row_ids)
        labels[row, : len(row_labels)] = torch.tensor(row_labels)
        mask[row, : len(row_ids)] = 1
    return ids, mask, labels


def _learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 20), then constant: the warm-up is
    meant to stop part-way through learning, so ``steps`` alone says how far it gets."""
    warmup = min(20, max(1, steps // 20))
    return peak * min(1.0, (step + 1) / warmup)


def warm_start(  # noqa: PLR0913  # keyword-only hyperparameters
    out_dir: Path,
    examples: Sequence[Example],
    *,
    size: str = "tiny",
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    threads: int = 1,
    log_every: int = 50,
    template: str = "default",
    on_step: OnStep | None = None,
) -> Path:
    """Create the tiny model of ``size`` (chat template ``template``) in ``out_dir`` and
    fine-tune it on ``examples``.

    ``steps`` AdamW updates of ``batch_size`` examples each, drawn by shuffled passes over
    ``examples`` (seeded). Logs a line every ``log_every`` steps with the loss, the rate and
    the time left, and calls ``on_step`` after every step (a progress bar's hook). Returns
    ``out_dir``, an ordinary model directory.
    """
    from server.common.tiny_model import create_tiny_model

    if not examples:
        raise ValueError("warm_start needs at least one example")
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}"
        )
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = create_tiny_model(out_dir, size, template)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    encoded = [encode_example(tokenizer, example) for example in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    model.train()
    rng = random.Random(seed)
    order: list[int] = []
    started = time.monotonic()
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(encoded)), len(encoded))
        picked, order = order[:batch_size], order[batch_size:]
        ids, mask, labels = _batch([encoded[i] for i in picked], tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps, lr)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, steps, loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.monotonic() - started
            rate = (step + 1) / elapsed
            log.info(
                "warm-up step %d/%d  loss %.4f  %.1f steps/s  %.0fs elapsed, ETA %.0fs",
                step + 1, steps, loss.item(), rate, elapsed, (steps - step - 1) / rate,
            )  # fmt: skip
    model.save_pretrained(out)
    return out


@torch.inference_mode()
def sample_completions(
    model_dir: Path,
    prompts: Sequence[Sequence[dict[str, Any]]],
    *,
    temperature: float = 1.0,
    max_tokens: int = 16,
    seed: int = 0,
    threads: int = 1,
    batch_size: int = 256,
) -> list[str]:
    """One completion per prompt, sampled as the engine samples (the full softmax at
    ``temperature``; 0 is greedy) until the end-of-turn token or ``max_tokens``; the text is
    decoded without special tokens, as the proxy returns it."""
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    encoded = [prompt_ids(tokenizer, messages) for messages in prompts]
    # Prompts of one length batch without padding, so positions are exact.
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    texts = [""] * len(prompts)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            outputs = _sample(
                model, [encoded[i] for i in chunk], temperature, max_tokens, stop, generator
            )
            decoded = tokenizer.batch_decode(outputs, skip_special_tokens=True)
            for index, text in zip(chunk, decoded, strict=True):
                texts[index] = text
    return texts


def _sample(
    model: Any,
    prompts: list[list[int]],
    temperature: float,
    max_tokens: int,
    stop: set[int],
    generator: torch.Generator,
) -> list[list[int]]:
    """Sample continuations of equal-length prompts with a KV cache."""
    inputs = torch.tensor(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache = DynamicCache(config=model.config)  # every forward extends it in place
    keyword = cache_keyword(model)
    for _ in range(max_tokens):
        result = model(input_ids=inputs, **{keyword: cache}, use_cache=True)
        logits = result.logits[:, -1].float()
        if temperature < 1e-6:
            tokens = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                outputs[row].append(token)
                done[row] = token in stop
        if all(done):
            break
        inputs = tokens.unsqueeze(-1)
    return outputs


# --- The cache ---------------------------------------------------------------------------------


def warm_start_key(examples: Sequence[Example], **settings: Any) -> str:
    """A digest of everything that shapes the warmed-up model: the examples, the settings, and
    the source of this module and of the tiny model's builder. (Threads are left out: they
    change the last bits of the arithmetic, not what is learned.)"""
    from server.common import tiny_model

    digest = hashlib.sha256()
    for source in (Path(__file__), Path(tiny_model.__file__)):
        digest.update(source.read_bytes())
    digest.update(json.dumps({"examples": examples, **settings}, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cached_warm_start(  # noqa: PLR0913  # warm_start's keyword-only hyperparameters
    cache_dir: Path,
    examples: Sequence[Example],
    *,
    size: str = "tiny",
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    threads: int = 1,
    log_every: int = 50,
    template: str = "default",
    on_step: OnStep | None = None,
) -> Path:
    """``warm_start`` into ``cache_dir/<key>``, or that directory at once when it is there.

    The model is trained in a temporary directory and renamed into place when complete, so an
    interrupted warm-up leaves nothing that looks finished, and two processes warming up the
    same key at once both end with the same, whole directory.
    """
    settings: dict[str, Any] = {
        "size": size, "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed,
    }  # fmt: skip
    if template != "default":  # so the default's cache keys stay as they were
        settings["template"] = template
    key = warm_start_key(examples, **settings)
    final = Path(cache_dir) / f"warm-{size}-{key}"
    if (final / MARKER).is_file():
        log.info("warm-up cached: %s", final)
        return final
    staging = Path(cache_dir) / f".staging-{key}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        started = time.monotonic()
        warm_start(
            staging, examples, **settings, threads=threads, log_every=log_every, on_step=on_step
        )
        record = {**settings, "examples": len(examples), "seconds": time.monotonic() - started}
        (staging / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        if (final / MARKER).is_file():  # another process finished the same model meanwhile
            return final
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover, if any
        try:
            os.replace(staging, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
            # Another process renamed the same model into place first: keep theirs.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
