"""A tool call the client sends back written differently still continues the row.

The model writes a call as text (``<tool_call>{json}</tool_call>``); the client gets its
arguments as JSON text and sends them back re-serialized (compact, reordered, as an object the
template dumps again). The splice rule reads the rendered block as the same call when its name
and arguments are the same JSON values (``server.proxy.prompts``, ``tool_calls.same_call``).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from server.proxy.prompts import splice
from server.proxy.session_cache import last_turn
from server.proxy.tool_calls import same_call
from server.text.tokenization import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}},
    }
]
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def _call(arguments: object, name: str = "calculator") -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def _next_prompt(tokenizer: Tokenizer, sampled_body: str, sent_back: object):
    """The prompt after the model wrote a call with ``sampled_body`` and the client sent the
    call back with arguments ``sent_back`` (text or an object) and its result."""
    prompt_ids = tokenizer.encode(
        tokenizer.render(QUESTION, tools=TOOLS, add_generation_prompt=True)
    )
    sampled = tokenizer.encode(
        "<tool_call>\n" + sampled_body + "\n</tool_call>"
    ) + tokenizer.encode("<|im_end|>")
    previous = last_turn(tokenizer, "c1", 0, prompt_ids, sampled)
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [_call(sent_back)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    text = tokenizer.render(history, tools=TOOLS, add_generation_prompt=True)
    return splice(tokenizer, text, [previous]), prompt_ids + sampled, text


SPACED = '{"name": "calculator", "arguments": {"expression": "2 + 2", "exact": true}}'


@pytest.mark.parametrize(
    "sent_back",
    [
        '{"expression":"2 + 2","exact":true}',  # compact (Qwen Code, any JSON.stringify)
        '{"exact": true, "expression": "2 + 2"}',  # keys in another order
        {"expression": "2 + 2", "exact": True},  # an object the template dumps (Anthropic input)
        '{"expression": "2 \\u002b 2", "exact": true}',  # another escape of the same text
    ],
)
def test_a_call_sent_back_written_differently_continues(tokenizer, sent_back):
    prompt, sampled, text = _next_prompt(tokenizer, SPACED, sent_back)
    assert prompt.continues is not None
    assert prompt.ids[: len(sampled)] == sampled  # the tokens the model sampled, as sampled
    assert tokenizer.decode(prompt.ids[len(sampled) :], skip_special_tokens=False) in text


@pytest.mark.parametrize(
    "sent_back",
    [
        '{"expression": "2 + 3", "exact": true}',  # another value
        '{"expression": "2 + 2", "exact": 1}',  # true is not 1
        '{"expression": "2 + 2"}',  # an argument left out
        '{"expression": "2 + 2", "exact": true, "x": null}',  # one added
    ],
)
def test_a_different_call_sent_back_breaks_the_row(tokenizer, sent_back):
    prompt, _, text = _next_prompt(tokenizer, SPACED, sent_back)
    assert prompt.continues is None
    assert prompt.ids == tokenizer.encode(text)


def test_a_call_to_another_tool_breaks_the_row(tokenizer):
    prompt_ids = tokenizer.encode(
        tokenizer.render(QUESTION, tools=TOOLS, add_generation_prompt=True)
    )
    sampled = tokenizer.encode("<tool_call>\n" + SPACED + "\n</tool_call><|im_end|>")
    previous = last_turn(tokenizer, "c1", 0, prompt_ids, sampled)
    renamed = _call('{"expression": "2 + 2", "exact": true}', name="search")
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [renamed]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "4"})
    text = tokenizer.render(history, tools=TOOLS, add_generation_prompt=True)
    assert splice(tokenizer, text, [previous]).continues is None


def test_a_block_that_was_no_call_must_come_back_as_it_was(tokenizer):
    """A block that is not a call went to the client as content: only the same text goes on."""
    prompt_ids = tokenizer.encode(tokenizer.render(QUESTION, add_generation_prompt=True))
    written = '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'  # no name: not a call
    previous = last_turn(tokenizer, "c1", 0, prompt_ids, tokenizer.encode(written + "<|im_end|>"))
    for content, goes_on in [(written, True), (written.replace(": 1", ":1"), False)]:
        history = [*QUESTION, {"role": "assistant", "content": content}]
        history.append({"role": "user", "content": "and?"})
        text = tokenizer.render(history, add_generation_prompt=True)
        assert (splice(tokenizer, text, [previous]).continues is not None) is goes_on


def test_same_call_reads_values_as_a_json_reader_does():
    call = '{{"name": "f", "arguments": {}}}'.format
    assert same_call(call('{"n": 1.0}'), call('{"n": 1}'))  # JSON.stringify(1.0) is "1"
    assert same_call(call('{"n": 12345678901234567890}'), call('{"n": 12345678901234567000}'))
    assert not same_call(call('{"n": true}'), call('{"n": 1}'))
    assert not same_call(call('{"n": 0}'), call('{"n": false}'))
    assert not same_call(call('{"n": null}'), call('{"n": 0}'))
    assert not same_call(call('{"n": [1, 2]}'), call('{"n": [2, 1]}'))
    assert not same_call(call('{"n": "1"}'), call('{"n": 1}'))
    assert not same_call(call('{"n": 1e400}'), call('{"n": 1e400}'))  # Infinity is no JSON
    huge = "9" * 400  # an integer no double holds is only itself
    assert same_call(call('{"n": ' + huge + "}"), call('{"n": ' + huge + "}"))
    assert not same_call(call('{"n": ' + huge + "}"), call('{"n": ' + huge[:-1] + "8}"))
    assert same_call(call('"{\\"n\\": 1}"'), call('{"n": 1}'))  # arguments as a string


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=4)
styles = st.fixed_dictionaries(
    {
        "separators": st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")]),
        "sort_keys": st.booleans(),
        "ensure_ascii": st.booleans(),
    }
)


@settings(max_examples=60, deadline=None)
@given(arguments, styles, styles)
def test_any_rewriting_of_the_same_arguments_continues(tokenizer, args, written, sent):
    body = json.dumps({"name": "calculator", "arguments": args}, **written)
    prompt, sampled, _ = _next_prompt(tokenizer, body, json.dumps(args, **sent))
    assert prompt.continues is not None
    assert prompt.ids[: len(sampled)] == sampled


@settings(max_examples=60, deadline=None)
@given(arguments, styles, st.data())
def test_changed_arguments_never_continue(tokenizer, args, written, data):
    changed = data.draw(arguments.filter(lambda other: json.dumps(other) != json.dumps(args)))
    body = json.dumps({"name": "calculator", "arguments": args}, **written)
    assume(not same_call(body, json.dumps({"name": "calculator", "arguments": changed})))
    prompt, _, _ = _next_prompt(tokenizer, body, json.dumps(changed))
    assert prompt.continues is None
