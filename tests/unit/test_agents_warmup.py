"""The agent lane's warm-up rests on two facts about the sliding-window tiny model: a completion's
probabilities after a prompt's last ``layers * window`` tokens (at their true positions) equal
those after the whole prompt, and ``sharpened`` multiplies the logits by its factor exactly."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from server.common.tiny_model import create_tiny_model
from tests.agents import warmup

WINDOW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = create_tiny_model(tmp_path_factory.mktemp("windowed") / "tiny", window=WINDOW)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == ("mistral", WINDOW)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _example(length: int, seed: int) -> warmup.Example:
    rng = random.Random(seed)
    return warmup.Example(
        [rng.randrange(600) for _ in range(length)], [rng.randrange(600) for _ in range(6)]
    )


@pytest.mark.parametrize("length", [40, 97, 300])
def test_the_prompt_tail_gives_the_full_prompt_completion(model, length):
    tail = warmup.reach(model.config)
    assert tail == model.config.num_hidden_layers * WINDOW
    example = _example(length, length)
    with torch.no_grad():
        (full,) = warmup.completion_logprobs(model, example)
        (cut,) = warmup.completion_logprobs(model, example, tail)
        (short,) = warmup.completion_logprobs(model, example, WINDOW)
    torch.testing.assert_close(cut, full, rtol=0, atol=1e-5)
    assert (short - full).abs().max() > 1e-4  # less than the reach is not the same


def test_sharpened_multiplies_the_logits(model):
    example = _example(50, 1)
    with torch.no_grad():
        (_, expected) = warmup.completion_logprobs(model, example, None, (1.0, 3.0))
        warmup.sharpened(model, 3.0)
        (got,) = warmup.completion_logprobs(model, example)
        warmup.sharpened(model, 1 / 3.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_full_attention_model_has_no_reach(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="sliding-window"):
        warmup.reach(model.config)
