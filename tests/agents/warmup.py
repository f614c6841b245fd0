"""Warm the tiny model up to drive a real agent: a tool call on the agent's first prompt, a short
answer once the tool's result is back.

The random tiny model never writes a well-formed tool call, so no agent could ever run a tool
through proxrl. A short supervised fine-tune on the agent's own rendered prompts (read from the
store after one run of the untrained model) teaches it two completions:

- the first prompt (system, tools, the task) ends in ``<tool_call>`` with the agent's shell
  tool and a command, then ``<|im_end|>``;
- the same prompt followed by that call and a ``<tool_response>`` ends in a short answer.

Real prompts are thousands of tokens; the model is RoPE (Llama), so attention sees relative
positions only, and training on windows of the prompt's tail (varied in length, the full
prompt among them) is enough for the full prompt to give the same completion. Training stops
once every completion token has probability above ``min_prob`` at temperature 1 on the full
prompts: agents send their own temperature, so the answer must not depend on greedy sampling.

This module knows nothing about agents or servers: it takes token ids and writes a model
directory.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TOOL_RESULTS = ["README.md\nsetup.py\nsrc\n", "hello.txt\n", "total 0\n", "a\nb\nc\n", "ok\n"]
ANSWER = "Done."


@dataclass(frozen=True)
class Example:
    """One prompt and the completion the warmed model must give it."""

    prompt_ids: list[int]
    completion_ids: list[int]


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the tiny model's chat template renders it (and its parser reads it)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def examples_for(tokenizer, prompt_ids: Sequence[int], name: str, arguments: dict) -> list[Example]:
    """The first turn (prompt -> tool call) and a second turn per made-up tool result
    (prompt, call, result -> a short answer), as the chat template renders them."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = [*tokenizer.encode(tool_call_text(name, arguments)), end]
    examples = [Example(list(prompt_ids), call)]
    for result in TOOL_RESULTS:
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


def _window(example: Example, length: int) -> tuple[list[int], int]:
    """The last ``length`` prompt tokens and the completion, and where the completion starts."""
    prompt = example.prompt_ids[-length:]
    return prompt + example.completion_ids, len(prompt)


def completion_probs(model, example: Example) -> list[float]:
    """Each completion token's probability at temperature 1 after the full prompt."""
    import torch

    ids, start = _window(example, len(example.prompt_ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    probs = logits.softmax(-1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
    return probs.tolist()


def warm_up(
    model_dir: Path,
    out_dir: Path,
    examples: Sequence[Example],
    min_prob: float = 0.995,
    max_steps: int = 600,
    window: int = 2048,
    full_share: float = 0.5,
    check_every: int = 10,
    seed: int = 0,
) -> dict:
    """Fine-tune ``model_dir`` on ``examples`` into ``out_dir`` (tokenizer files copied along);
    returns how it went: steps taken and the lowest completion-token probability reached."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first, seconds = examples[0], examples[1:]
    lowest, step = 0.0, 0
    for step in range(1, max_steps + 1):
        model.train()
        optimizer.zero_grad()
        batch = [first, rng.choice(seconds)] if seconds else [first]
        for example in batch:
            full = len(example.prompt_ids)
            short = rng.randint(min(32, full), min(window, full))
            length = full if rng.random() < full_share else short
            ids, start = _window(example, length)
            logits = model(torch.tensor([ids])).logits[0, start - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[start:]))
            (loss / len(batch)).backward()
        optimizer.step()
        if step % check_every == 0:
            model.eval()
            lowest = min(min(completion_probs(model, e)) for e in examples[:2])
            print(f"warm-up step {step}: loss {loss.item():.4f}, lowest p {lowest:.4f}", flush=True)
            if lowest >= min_prob:
                lowest = min(min(completion_probs(model, e)) for e in examples)
                if lowest >= min_prob:
                    break
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(model_dir, out_dir)
    model.save_pretrained(out_dir)
    return {"steps": step, "lowest_prob": lowest}
