"""Coalescing a stream's tokens changes its chunks, never what a client gathers from them.

The pure core of a streamed chat answer: a choice's streamed text (``outputs.ChoiceText``: UTF-8
decoded incrementally, stop strings held back, tool calls split out) fed the same token ids in
any grouping (one token a push, as the bound off sends them, or any run of tokens joined, as
the bound coalesces them), each push's events made one chat delta (``chat._merged``). What a
client gathers, as OpenAI's SDK does (content joined, reasoning joined, tool calls in order by
their name and arguments), is the same for every grouping, and equals the text's parse
(``tool_calls.parse_tool_calls``). The texts hold multi-byte characters, which the tiny model's
byte-level tokens cut, and tool calls whose JSON any grouping may cut anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.proxy import outputs
from server.proxy.chat import _merged
from server.proxy.generation import Completion
from server.proxy.tool_calls import ToolNames, parse_tool_calls
from server.text.tokenization import Tokenizer

TEXTS = [
    'Checking: "ça va" 🌧 日本.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Zürich 🌧 東京"}}\n</tool_call>',
    "Zürich, 東京 and 🙂: fine. " * 3,
    "🙂" * 4 + " é日本 <tool_call>{not json</tool_call> then <tool_call>"
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"パリ\\"}"}</tool_call> end',
]
TOOLS = {"get_weather"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def gathered(tokenizer: Tokenizer, ids: list[int], groups: list[list[int]]) -> tuple:
    """Content, reasoning and tool calls (name, arguments) a client gathers from the chat
    deltas of ``groups`` pushed in turn, then the finish's."""
    choice = outputs.ChoiceText(tokenizer, (), TOOLS, reasoning=True)
    deltas = [_merged(choice.push(group)) for group in groups]
    completion = Completion(prompt_ids=[], ids=ids, finish_reason={"type": "length"})
    deltas += [_merged([event]) for event in choice.finish(completion)]
    content = "".join(delta.get("content", "") for delta in deltas)
    reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
    calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for delta in deltas
        for call in delta.get("tool_calls", [])
    ]
    return content, reasoning, calls


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(TEXTS), data=st.data())
def test_any_grouping_of_the_tokens_gathers_the_same_answer(tokenizer: Tokenizer, text, data):
    ids = tokenizer.encode(text)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1))))
    groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    one_by_one = gathered(tokenizer, ids, [[token] for token in ids])
    assert gathered(tokenizer, ids, groups) == one_by_one
    parsed = parse_tool_calls(text, ToolNames(TOOLS))
    content, _, calls = one_by_one
    assert content == (parsed.content or "")
    assert calls == [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_one_push_of_text_and_a_call_is_one_delta_with_both(tokenizer: Tokenizer):
    """Coalesced, a call and the text before it are one delta of one choice entry (a reader
    of the first entry misses neither)."""
    ids = tokenizer.encode(TEXTS[0])
    choice = outputs.ChoiceText(tokenizer, (), TOOLS, reasoning=True)
    delta = _merged(choice.push(ids))
    assert delta["content"] == 'Checking: "ça va" 🌧 日本.'
    (call,) = delta["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["index"] == 0
