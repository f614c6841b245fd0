"""Reasoning, for real: the tiny model with the reasoning chat template, warmed up (a short,
cached supervised warm-up) to answer ``<think>\\n...\\n</think>\\n\\n`` then the answer, served by a
live ``proxrl serve``. A 5-turn conversation on each surface keeps one row: no breaks, and the
row is exactly what was sampled. On chat the agent sends back only ``content``
(``reasoning_content`` dropped, as OpenAI clients drop it); on the Responses API its output
items, reasoning items included; on Anthropic Messages its content blocks, thinking included."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from server.proxy.reasoning import ReasoningStyle, split_reasoning
from server.text.tokenization import Tokenizer
from tests.support import ROOT, ProxyProcess

# The first run warms the model up (80 steps: 164 s on two busy cores), then it is cached.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WARMUP = {"steps": 80, "lr": 3e-3, "batch_size": 8, "seed": 0}
QUESTIONS = ["What is 3 + 4?", "What is 12 + 5?", "And 7 + 7?", "What is 1 + 19?", "And 6 + 2?"]


def reasoning_examples(count: int, seed: int = 0) -> list:
    """Sums to answer with reasoning first; half of them after an earlier exchange, rendered
    as the template renders history (without its reasoning)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
        if rng.random() < 0.5:
            c, d = rng.randint(0, 20), rng.randint(0, 20)
            messages = [
                {"role": "user", "content": f"What is {c} + {d}?"},
                {"role": "assistant", "content": f"The answer is {c + d}."},
                *messages,
            ]
        examples.append(
            (messages, f"<think>\n{a} + {b} = {a + b}\n</think>\n\nThe answer is {a + b}.")
        )
    return examples


@pytest.fixture(scope="module")
def reasoning_model() -> Path:
    from trainer.warmup import cached_warm_start

    examples = reasoning_examples(1000)
    cache = ROOT / ".proxrl-cache"
    return cached_warm_start(cache, examples, threads=2, template="reasoning", **WARMUP)


@pytest.fixture(scope="module")
def proxy(reasoning_model: Path, tmp_path_factory):
    with ProxyProcess(reasoning_model, tmp_path_factory.mktemp("proxy")) as process:
        yield process.wait_ready()


def _streamed(client: httpx.Client, key: dict, body: dict) -> dict:
    """A streamed answer's message, joined from its deltas."""
    message = {"content": "", "reasoning_content": ""}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=key) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                for field in message:
                    message[field] += choice["delta"].get(field) or ""
    return message


def _split(tokenizer: Tokenizer, turn: dict) -> tuple[str, str]:
    """A turn's sampled text as the proxy serves it: (reasoning, answer)."""
    reasoning, content = split_reasoning(
        tokenizer.decode(turn["completion_ids"]), ReasoningStyle(True, False)
    )
    return reasoning or "", content


def _assert_one_exact_row(view: dict, tokenizer: Tokenizer, history: str) -> list[dict]:
    """No breaks, one row, and the row holds each turn's prompt and completion as sampled; the
    history the template rendered has no reasoning, the row does. The turns."""
    assert view["breaks"] == 0 and view["row_count"] == 1
    turns, (row,) = view["turns"], view["rows"]
    assert [t["extends_previous"] for t in turns] == [False, True, True, True, True]
    for turn, span in zip(turns, row["turns"], strict=True):
        assert row["input_ids"][: span["start"]] == turn["prompt_ids"]
        assert row["input_ids"][span["start"] : span["end"]] == turn["completion_ids"]
        assert row["logprobs"][span["start"] : span["end"]] == turn["logprobs"]
    assert sum(row["loss_mask"]) == sum(len(t["completion_ids"]) for t in turns)
    # The warmed-up model reasons; the row goes on although the rendered history dropped that.
    assert any(_split(tokenizer, turn)[0] for turn in turns)
    assert "<think>" not in history
    assert "<think>" in tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    return turns


def test_chat_keeps_one_exact_row(proxy, reasoning_model):
    tokenizer = Tokenizer.from_pretrained(reasoning_model)
    served = []
    session = proxy.session()
    with httpx.Client(base_url=proxy.url, timeout=120) as client:
        key = {"Authorization": f"Bearer {session['api_key']}"}
        messages: list[dict] = []
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            body = {"model": "any-name", "messages": messages, "max_tokens": 40}
            if turn % 2:
                message = _streamed(client, key, {**body, "stream": True})
            else:
                reply = client.post("/v1/chat/completions", json=body, headers=key)
                assert reply.status_code == 200, reply.text
                message = reply.json()["choices"][0]["message"]
            served.append(message)
            messages.append({"role": "assistant", "content": message["content"]})
    view = proxy.get_session(session["session_id"])
    turns = _assert_one_exact_row(view, tokenizer, tokenizer.render(messages))
    for turn, message in zip(turns, served, strict=True):
        reasoning, content = _split(tokenizer, turn)
        assert (message.get("reasoning_content") or "", message["content"]) == (reasoning, content)


def test_responses_keep_one_exact_row(proxy, reasoning_model):
    """The Responses API, its output items (reasoning items included) sent back as input."""
    tokenizer = Tokenizer.from_pretrained(reasoning_model)
    session = proxy.session()
    items: list[dict] = []
    outputs = []
    with httpx.Client(base_url=proxy.url, timeout=120) as client:
        key = {"Authorization": f"Bearer {session['api_key']}"}
        for question in QUESTIONS:
            items.append({"role": "user", "content": question})
            body = {"model": "any-name", "input": items, "max_output_tokens": 40}
            reply = client.post("/v1/responses", json=body, headers=key)
            assert reply.status_code == 200, reply.text
            outputs.append(reply.json()["output"])
            items += reply.json()["output"]
    view = proxy.get_session(session["session_id"])
    history = [{"role": "user", "content": q} for q in QUESTIONS]
    turns = _assert_one_exact_row(view, tokenizer, tokenizer.render(history))
    for turn, output in zip(turns, outputs, strict=True):
        texts = {item["type"]: item["content"][0]["text"] for item in output}
        reasoning, content = _split(tokenizer, turn)
        assert (texts.get("reasoning", ""), texts.get("message", "")) == (reasoning, content)


def test_anthropic_messages_keep_one_exact_row(proxy, reasoning_model):
    """Anthropic Messages, its content blocks (thinking included) sent back as they came."""
    tokenizer = Tokenizer.from_pretrained(reasoning_model)
    session = proxy.session()
    messages: list[dict] = []
    answers = []
    with httpx.Client(base_url=proxy.url, timeout=120) as client:
        key = {"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"}
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            body = {"model": "any-name", "messages": messages, "max_tokens": 40}
            reply = client.post("/v1/messages", json=body, headers=key)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["content"])
            messages.append({"role": "assistant", "content": reply.json()["content"]})
    view = proxy.get_session(session["session_id"])
    history = [{"role": "user", "content": q} for q in QUESTIONS]
    turns = _assert_one_exact_row(view, tokenizer, tokenizer.render(history))
    for turn, blocks in zip(turns, answers, strict=True):
        thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        assert (thinking, text) == _split(tokenizer, turn)
