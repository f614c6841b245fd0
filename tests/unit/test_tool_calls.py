"""Hermes-style ``<tool_call>`` blocks to OpenAI tool calls: the parse, the stream, and that they
agree however the text is chunked."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.proxy.tool_calls import (
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    malformed_blocks,
    parse_tool_calls,
)


def block(name: str, arguments: object = None, *, raw: str | None = None) -> str:
    """A tool-call block as the model writes it, with the usual newlines."""
    if raw is None:
        payload = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
        raw = json.dumps(payload, ensure_ascii=False)
    return f"<tool_call>\n{raw}\n</tool_call>"


CALC = block("calculator", {"expression": "2+2"})
WEATHER = block("get_weather", {"city": "Paris", "unit": "celsius"})


def signature(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def stream(
    chunks: list[str], tool_names: set[str] | None = None
) -> tuple[str, list[ToolCall], list[ContentDelta | ToolCallDelta]]:
    """Feed ``chunks`` to a fresh stream; return its content, its calls and all its events."""
    parser = ToolCallStream(tool_names)
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert all(e.text for e in events if isinstance(e, ContentDelta))
    return content, [d.call for d in deltas], events


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def assert_stream_matches_parse(
    text: str, rng: random.Random, tool_names: set[str] | None = None
) -> None:
    parsed = parse_tool_calls(text, tool_names)
    for chunks in (list(text), [text], random_chunks(text, rng), random_chunks(text, rng)):
        content, calls, _ = stream(chunks, tool_names)
        assert content == (parsed.content or ""), (text, chunks)
        assert signature(calls) == signature(parsed.tool_calls), (text, chunks)


# --- parse_tool_calls ---------------------------------------------------------------------------


def test_single_call():
    parsed = parse_tool_calls(CALC)
    assert parsed.content is None
    (call,) = parsed.tool_calls
    assert call.name == "calculator"
    assert call.arguments == '{"expression": "2+2"}'


def test_several_calls_in_order():
    parsed = parse_tool_calls(f"{CALC}\n{WEATHER}\n{block('calculator', {'expression': '3'})}")
    assert parsed.content is None
    assert signature(parsed.tool_calls) == [
        ("calculator", {"expression": "2+2"}),
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("calculator", {"expression": "3"}),
    ]


def test_ids_are_openai_shaped_and_unique():
    calls = parse_tool_calls(CALC * 50).tool_calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert len({call.id for call in calls}) == 50


def test_text_before_calls_is_content_stripped():
    parsed = parse_tool_calls(f"  Let me compute that.\n\n{CALC}\n{WEATHER}\n")
    assert parsed.content == "Let me compute that."
    assert [call.name for call in parsed.tool_calls] == ["calculator", "get_weather"]


def test_text_between_and_after_calls_keeps_inner_whitespace():
    parsed = parse_tool_calls(f"First.\n{CALC}\nThen.\n{WEATHER}\nDone. ")
    assert parsed.content == "First.\n\nThen.\n\nDone."
    assert len(parsed.tool_calls) == 2


def test_no_calls():
    assert parse_tool_calls("Just an answer.\n") == ParsedOutput("Just an answer.", [])
    assert parse_tool_calls("") == ParsedOutput("", [])
    assert parse_tool_calls(" \n ") == ParsedOutput("", [])


def test_arguments_given_as_json_string():
    text = block(
        "calculator", raw='{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'
    )
    (call,) = parse_tool_calls(text).tool_calls
    assert call.arguments == '{"expression": "1"}'


def test_absent_arguments_are_empty_object():
    (call,) = parse_tool_calls(block("list_files")).tool_calls
    assert call.name == "list_files" and call.arguments == "{}"


def test_block_without_whitespace_around_json():
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls
    assert call.name == "f"


def test_unicode_arguments_are_not_escaped():
    text = block("translate", {"text": "héllo wörld 你好 🙂"})
    (call,) = parse_tool_calls(text).tool_calls
    assert call.arguments == '{"text": "héllo wörld 你好 🙂"}'
    escaped = block("translate", raw='{"name": "translate", "arguments": {"text": "\\u00e9"}}')
    assert parse_tool_calls(escaped).tool_calls[0].arguments == '{"text": "é"}'


def test_nested_arguments_and_braces_in_strings():
    arguments = {"filter": {"and": [{"x": {"gt": 1}}, {"y": "}{"}]}, "code": 'f = {"a": [1]}'}
    (call,) = parse_tool_calls(block("query", arguments)).tool_calls
    assert json.loads(call.arguments) == arguments


@pytest.mark.parametrize(
    "bad",
    [
        block("x", raw="not json"),
        block("x", raw='{"name": "f", "arguments": {}'),  # truncated
        block("x", raw='["f", {}]'),  # not an object
        block("x", raw='{"arguments": {}}'),  # no name
        block("x", raw='{"name": 3, "arguments": {}}'),
        block("x", raw='{"name": "", "arguments": {}}'),
        block("x", raw='{"name": "f", "arguments": [1]}'),
        block("x", raw='{"name": "f", "arguments": null}'),
        block("x", raw='{"name": "f", "arguments": "not json"}'),
        block("x", raw='{"name": "f", "arguments": "[1, 2]"}'),  # string, but not an object
        block("x", raw='{"name": "f", "arguments": {"x": NaN}}'),
        block("x", raw='{"name": "f", "arguments": {"x": -Infinity}}'),
        block("x", raw="[" * 100_000 + "]" * 100_000),  # deeper than json's recursion limit
        "<tool_call></tool_call>",
    ],
)
def test_invalid_block_stays_content_verbatim(bad: str):
    text = f"Before.\n{bad}\nAfter."
    assert parse_tool_calls(text) == ParsedOutput(text, [])
    assert parse_tool_calls(bad) == ParsedOutput(bad, [])
    assert malformed_blocks(text) == 1  # left as text, and counted


@given(st.lists(st.sampled_from(["call", "bad", "unknown", "prose"]), max_size=8), st.booleans())
def test_every_block_is_a_call_or_counted_malformed(kinds: list[str], unclosed: bool):
    pieces = {
        "call": block("f", {"x": 1}),
        "bad": block("x", raw='{"name": "f", "arguments": [1]}'),
        "unknown": block("g", {}),
        "prose": "some words <tool_",
    }
    text = " ".join(pieces[kind] for kind in kinds) + (" <tool_call> {" if unclosed else "")
    calls = len(parse_tool_calls(text, {"f"}).tool_calls)
    assert calls == kinds.count("call")
    assert malformed_blocks(text, {"f"}) == kinds.count("bad") + kinds.count("unknown") + unclosed


def test_invalid_block_next_to_valid_call():
    bad = block("x", raw="{oops}")
    parsed = parse_tool_calls(f"{bad}\n{CALC}")
    assert parsed.content == bad
    assert [call.name for call in parsed.tool_calls] == ["calculator"]


def test_unknown_tool_stays_content_when_tool_names_given():
    text = f"{CALC}\n{WEATHER}"
    parsed = parse_tool_calls(text, tool_names={"calculator"})
    assert parsed.content == WEATHER
    assert [call.name for call in parsed.tool_calls] == ["calculator"]
    assert parse_tool_calls(text, tool_names=set()) == ParsedOutput(text, [])
    assert len(parse_tool_calls(text).tool_calls) == 2  # no tool_names: any name goes


def test_unclosed_block_stays_content():
    truncated = 'I will call it.\n<tool_call>\n{"name": "calculator", "argu'
    assert parse_tool_calls(truncated) == ParsedOutput(truncated, [])
    parsed = parse_tool_calls(f"{CALC}\n<tool_call>\n{{")
    assert parsed.content == "<tool_call>\n{"
    assert len(parsed.tool_calls) == 1


def test_first_close_marker_ends_the_block():
    """A JSON string holding the literal "</tool_call>" cuts its block short: the cut body is not
    JSON, so everything up to the first "</tool_call>" stays content, and the rest after it too."""
    text = block("echo", {"text": "a </tool_call> b"})
    assert parse_tool_calls(text) == ParsedOutput(text, [])
    # The escaped form a careful model could write is fine: json.dumps never emits "<\/".
    escaped = block("echo", raw='{"name": "echo", "arguments": {"text": "a <\\/tool_call> b"}}')
    (call,) = parse_tool_calls(escaped).tool_calls
    assert json.loads(call.arguments) == {"text": "a </tool_call> b"}


def test_open_marker_inside_a_block_is_plain_text():
    text = f"<tool_call>oops {CALC}"
    assert parse_tool_calls(text) == ParsedOutput(text, [])


def test_stray_markers_are_content():
    for text in ["a </tool_call> b", "a <tool_call b", "<tool_calls>x</tool_calls>", "a < b"]:
        assert parse_tool_calls(text) == ParsedOutput(text, [])


def test_to_openai():
    call = ToolCall(id="call_" + "0" * 24, name="calculator", arguments='{"expression": "2"}')
    function = {"name": "calculator", "arguments": '{"expression": "2"}'}
    assert call.to_openai() == {"id": call.id, "type": "function", "function": function}
    streamed = call.to_openai(index=2)
    assert streamed == {"index": 2, "id": call.id, "type": "function", "function": function}
    assert json.loads(json.dumps(streamed)) == streamed


# --- ToolCallStream -----------------------------------------------------------------------------


def test_stream_text_only_goes_out_as_it_comes():
    parser = ToolCallStream()
    assert parser.feed("Hello") == [ContentDelta("Hello")]
    assert parser.feed(" wor") == [ContentDelta(" wor")]
    assert parser.feed("ld!") == [ContentDelta("ld!")]
    assert parser.finish() == []


def test_stream_holds_a_possible_marker_then_releases_it():
    parser = ToolCallStream()
    assert parser.feed("a <") == [ContentDelta("a")]
    assert parser.feed("tool") == []
    assert parser.feed("_c") == []
    assert parser.feed("x") == [ContentDelta(" <tool_cx")]
    assert parser.feed("<") == []
    assert parser.finish() == [ContentDelta("<")]


def test_stream_holds_trailing_whitespace_until_content_follows():
    parser = ToolCallStream()
    assert parser.feed("\n  Hi") == [ContentDelta("Hi")]  # leading whitespace dropped
    assert parser.feed("\n\n") == []
    assert parser.feed("there") == [ContentDelta("\n\nthere")]
    assert parser.feed(" \n") == []
    assert parser.finish() == []  # trailing whitespace dropped


def test_stream_emits_a_call_when_its_block_closes():
    parser = ToolCallStream()
    assert parser.feed("Let me check.\n") == [ContentDelta("Let me check.")]
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "calculator", "arguments": {"expression": "2+2"}}\n') == []
    assert parser.feed("</tool_call") == []
    (event,) = parser.feed(">\n")
    assert isinstance(event, ToolCallDelta) and event.index == 0
    assert event.call.name == "calculator"
    assert event.call.arguments == '{"expression": "2+2"}'
    assert parser.finish() == []


def test_stream_indexes_calls_in_order():
    _, calls, events = stream([CALC, "\n", WEATHER, "\n", CALC])
    assert [c.name for c in calls] == ["calculator", "get_weather", "calculator"]
    assert [e.index for e in events if isinstance(e, ToolCallDelta)] == [0, 1, 2]
    assert len({c.id for c in calls}) == 3


def test_stream_invalid_block_goes_out_whole_as_content():
    bad = block("x", raw="{nope}")
    content, calls, events = stream(list(f"Hi\n{bad}\n"))
    assert content == "Hi\n" + bad and not calls
    assert events[-1] == ContentDelta("\n" + bad)  # held until it closed, then sent at once


def test_stream_unknown_tool_is_content():
    content, calls, _ = stream(list(f"{WEATHER}\n{CALC}"), tool_names={"calculator"})
    assert content == WEATHER
    assert [c.name for c in calls] == ["calculator"]


def test_stream_unclosed_block_flushed_at_finish():
    parser = ToolCallStream()
    assert parser.feed('Sure.\n<tool_call>\n{"name": "calc') == [ContentDelta("Sure.")]
    assert parser.finish() == [ContentDelta('\n<tool_call>\n{"name": "calc')]


def test_stream_never_sends_partial_markup_before_a_call():
    for seed in range(50):
        rng = random.Random(seed)
        text = f"Let me look that up.\n\n{CALC}\n{WEATHER}\n"
        _, calls, events = stream(random_chunks(text, rng))
        sent = [e.text for e in events if isinstance(e, ContentDelta)]
        assert sent and "".join(sent) == "Let me look that up."
        assert not any("<" in piece or "\n" in piece for piece in sent)
        assert len(calls) == 2


@pytest.mark.parametrize(
    "text",
    [
        CALC,
        f"{CALC}\n{WEATHER}",
        f"Let me compute.\n\n{CALC}\n{WEATHER}\n",
        "Just text, with a < sign and <tool_calls> and </tool_call>.",
        "",
        " \n",
        f"First.\n{CALC}\nThen.\n{WEATHER}\nDone. ",
        f"{block('x', raw='{bad')}\n{CALC}",
        block("echo", {"text": "a </tool_call> b"}),
        block("translate", {"text": "héllo 你好 🙂"}),
        block("query", {"f": {"g": ["}", "{", '"']}}),
        f"<tool_call>oops {CALC}",
        f'Ran out.\n{CALC}\n<tool_call>\n{{"name": "ca',
        f"{CALC}<tool",
        "<<tool_call<tool_call>\n{}\n</tool_call>",
    ],
)
def test_stream_matches_parse_on_examples(text: str):
    for seed in range(20):
        assert_stream_matches_parse(text, random.Random(seed))


# Pieces a model's output is glued from, chosen to land markers and whitespace on every boundary.
PIECES = [
    "Hello",
    " ",
    "\n",
    "\n\n",
    "é 你好",
    "<",
    "<tool",
    "<tool_call",
    "<tool_call>",
    "</tool_call>",
    "</tool_call",
    "{",
    '"',
    CALC,
    WEATHER,
    block("list_files"),
    block("translate", {"text": "🙂 </tool_call"}),
    block("x", raw="{broken"),
    block("unknown_tool", {"a": 1}),
]


@pytest.mark.parametrize("tool_names", [None, {"calculator", "get_weather", "list_files"}])
def test_stream_matches_parse_on_random_texts(tool_names: set[str] | None):
    for seed in range(400):
        rng = random.Random(seed)
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10)))
        assert_stream_matches_parse(text, rng, tool_names)


def test_served_choices_count_their_malformed_blocks_by_surface(tiny_model_dir):
    """``answer.count_malformed_calls`` on real completions: the tiny tokenizer's ids of a text
    with one bad block and one good call add 1 to ``proxrl_malformed_tool_calls{surface}``."""
    from types import SimpleNamespace

    from server.metrics import Metrics
    from server.proxy.answer import count_malformed_calls
    from server.proxy.generation import Completion
    from server.text.tokenization import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    text = block("x", raw='{"name": "f", "arguments": [1]}') + " " + block("f", {"x": 1})
    completion = Completion(prompt_ids=[1], ids=tokenizer.encode(text))
    ctx = SimpleNamespace(tokenizer=tokenizer, metrics=Metrics())
    log = SimpleNamespace(surface="messages")
    count = ctx.metrics.registry.get_sample_value
    labels = {"surface": "messages"}
    count_malformed_calls(ctx, SimpleNamespace(tool_names=None, log=log, forced=""), [completion])
    assert count("proxrl_malformed_tool_calls_total", labels) is None  # no tools: not parsed
    count_malformed_calls(
        ctx, SimpleNamespace(tool_names={"f"}, log=log, forced=""), [completion] * 2
    )
    assert count("proxrl_malformed_tool_calls_total", labels) == 2.0
