"""Warm the tiny model up to drive a real agent: a tool call on the agent's first prompt, a short
answer once the tool's result is back.

The random tiny model never writes a well-formed tool call, so no agent could ever run a tool
through proxrl. A short supervised fine-tune on the agent's own rendered prompts (read from the
store after one run of the untrained model) teaches it two completions:

- the first prompt (system, tools, the task) ends in ``<tool_call>`` with the agent's shell
  tool and a command, then ``<|im_end|>``;
- the same prompt followed by that call and a ``<tool_response>`` ends in a short answer.

Real prompts are thousands of tokens, too many to fine-tune on quickly on two CPU cores. The
model is a sliding-window one (``tiny_model.create_tiny_model(window=...)``): each layer sees the
last ``window`` tokens, so a completion depends on the prompt's last ``layers * window`` tokens
only, and training on that tail (at its true positions) is training on the full prompt, exactly.
Training stops once each completion, whole, has probability at least ``min_prob`` at
temperature 1 (agents send their own temperature, so the answer must not depend on greedy
sampling; a tool call is dozens of tokens, so each token's probability alone says too little);
the full prompts are checked once at the end.

This module knows nothing about agents or servers: it takes token ids and writes a model
directory.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

TOOL_OUTPUTS = ["notes.txt", "README.md\nsetup.py\nsrc", "hello.txt", "total 0", "a\nb\nc", "ok"]
ANSWER = "Done."


@dataclass(frozen=True)
class Example:
    """One prompt and the completion the warmed model must give it."""

    prompt_ids: list[int]
    completion_ids: list[int]


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the tiny model's chat template renders it (and its parser reads it), with
    Python's JSON spacing. An agent in JavaScript sends the call back compact
    (``JSON.stringify``), Claude Code as an object the template dumps again: the splice reads
    either as the same call (``server.proxy.prompts``), so the row goes on with the tokens the
    model sampled, and the lane shows it on every agent."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def examples_for(
    tokenizer,
    prompt_ids: Sequence[int],
    name: str,
    arguments: dict,
    result_format: str | Callable[[str], str] = "{output}",
) -> list[Example]:
    """The first turn (prompt -> tool call) and a second turn per made-up tool output
    (prompt, call, result -> a short answer), as the chat template renders them; the agent
    wraps a command's output in its tool result as ``result_format`` shows (a format with an
    ``{output}`` field, or a function of the output: a result whose other parts vary, such as
    an id or a time, varies across the examples so that the model learns to answer any)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = [*tokenizer.encode(tool_call_text(name, arguments)), end]
    examples = [Example(list(prompt_ids), call)]
    for output in TOOL_OUTPUTS:
        result = (
            result_format(output)
            if callable(result_format)
            else result_format.format(output=output)
        )
        follow = tokenizer.encode(
            f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        answer = [*tokenizer.encode(ANSWER), end]
        examples.append(Example([*prompt_ids, *call, *follow], answer))
    return examples


def cache_key(model_dir: Path, examples: Sequence[Example]) -> str:
    """What a warmed model depends on: the base weights, the examples, this file."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update((model_dir / "model.safetensors").read_bytes())
    digest.update(json.dumps([(e.prompt_ids, e.completion_ids) for e in examples]).encode())
    return digest.hexdigest()[:16]


def reach(config) -> int:
    """How many of a prompt's last tokens the model's next token depends on."""
    window = getattr(config, "sliding_window", None)
    if not window:
        raise ValueError("the warm-up needs a sliding-window model (create_tiny_model(window=...))")
    return config.num_hidden_layers * window


def completion_logprobs(model, example: Example, tail: int | None = None, sharpen=(1.0,)):
    """Each completion token's logprob at temperature 1 after the prompt's last ``tail`` tokens
    (None: the whole prompt), at their positions in the whole prompt: a tensor per factor of
    ``sharpen``, the logits multiplied by it (what ``sharpened`` makes of the model)."""
    import torch

    prompt = example.prompt_ids[-tail:] if tail else example.prompt_ids
    ids = torch.tensor([prompt + example.completion_ids])
    first = len(example.prompt_ids) - len(prompt)
    positions = torch.arange(first, first + ids.shape[1])[None]
    logits = model(input_ids=ids, position_ids=positions).logits[0, len(prompt) - 1 : -1].float()
    targets = ids[0, len(prompt) :, None]
    return [(logits * k).log_softmax(-1).gather(1, targets)[:, 0] for k in sharpen]


SHARPEN = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def sharpened(model, factor: float) -> None:
    """Multiply the model's logits by ``factor``: its final norm's weight, which feeds the
    (bias-free) output layer, scaled in place."""
    import torch

    with torch.no_grad():
        model.model.norm.weight.mul_(factor)


def warm_up(
    model_dir: Path,
    out_dir: Path,
    examples: Sequence[Example],
    min_prob: float = 0.999,
    lr: float = 3e-3,
    max_steps: int = 1000,
    check_every: int = 5,
    seed: int = 0,
) -> dict:
    """Fine-tune ``model_dir`` on ``examples`` into ``out_dir`` (tokenizer files copied along)
    until each completion, whole, has probability ``min_prob`` at temperature 1, its logits
    sharpened by the smallest factor of ``SHARPEN`` that gets there (a fine-tune alone nears 1
    slowly: hundreds of steps from 0.9 to 0.99); returns how it went: steps and seconds taken,
    the factor, the lowest completion probability and completion-token probability on the full
    prompts, and the largest difference between the full prompts' token probabilities and the
    tails' (float error)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    )
    tail = reach(model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    first, seconds = examples[0], examples[1:]
    start, step, factor, lowest = time.monotonic(), 0, None, {}
    for step in range(1, max_steps + 1):
        model.train()
        optimizer.zero_grad()
        batch = [first, rng.choice(seconds)] if seconds else [first]
        for example in batch:
            (logprobs,) = completion_logprobs(model, example, tail)
            loss = -logprobs.sum()
            (loss / len(batch)).backward()
        optimizer.step()
        if step % check_every == 0:
            model.eval()
            with torch.no_grad():
                each = [completion_logprobs(model, e, tail, SHARPEN) for e in examples]
                lowest = {
                    k: min(lps[n].sum().exp().item() for lps in each) for n, k in enumerate(SHARPEN)
                }
            shown = ", ".join(f"x{k:g} {p:.4f}" for k, p in lowest.items())
            print(f"warm-up step {step}: lowest completion p {shown}", flush=True)
            factor = next((k for k in SHARPEN if lowest[k] >= min_prob), None)
            if factor is not None:
                sharpened(model, factor)
                break
    if factor is None:
        raise RuntimeError(f"the warm-up did not reach {min_prob} in {max_steps} steps: {lowest}")
    seconds_taken = time.monotonic() - start
    model.eval()
    with torch.no_grad():
        full = [completion_logprobs(model, e)[0] for e in examples]
        tails = [completion_logprobs(model, e, tail)[0] for e in examples]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(model_dir, out_dir)
    model.save_pretrained(out_dir)
    return {
        "steps": step,
        "seconds": round(seconds_taken, 1),
        "sharpen": factor,
        "lowest_prob": min(lp.sum().exp().item() for lp in full),
        "lowest_token_prob": min(lp.min().exp().item() for lp in full),
        "tail_vs_full": max(
            (f.exp() - t.exp()).abs().max().item() for f, t in zip(full, tails, strict=True)
        ),
    }
