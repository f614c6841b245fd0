"""The pure parts of the Anthropic Messages surface: the content blocks an answer's text and
tool-call events build (streamed in any chunking, or at once: the same blocks), the request's
conversation as chat-template messages, and the dashboard's transcript of Anthropic turns."""

from __future__ import annotations

import itertools
import json

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from server.dashboard.transcript import transcript
from server.proxy.anthropic import MessagesRenderer, _Blocks, _events, conversation
from server.proxy.anthropic_schemas import MessagesRequest
from server.proxy.tool_calls import ReasoningDelta, ToolCallStream
from server.rl.schemas import TurnOut
from tests.support import turn_out

EVENT = TypeAdapter(RawMessageStreamEvent)
USAGE = {"input_tokens": 1, "output_tokens": 0}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
TEXT = f"Let me add.\n{CALL}\nThen\n{CALL}"
NAMES = {"calculator"}


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _streamed(text: str, cuts: list[int]) -> tuple[list[dict], list[dict]]:
    """The blocks and events of a reasoning ("Think." in two pieces) and ``text`` streamed in
    pieces cut at ``cuts``."""
    blocks, calls = _Blocks(), ToolCallStream(NAMES)
    events = blocks.push([ReasoningDelta("Thi"), ReasoningDelta("nk.")])
    for piece in _chunks(text, cuts):
        events += blocks.push(calls.feed(piece))
    events += blocks.push(calls.finish()) + blocks.close()
    return blocks.content, events


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_streamed_blocks_are_the_blocks_of_the_whole_text_however_it_is_cut(cuts):
    whole = _Blocks()
    whole.push(_events("Think.", TEXT, NAMES))
    streamed, _ = _streamed(TEXT, cuts)
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == [
        {k: v for k, v in b.items() if k != "id"} for b in whole.content
    ]
    kinds = [block["type"] for block in whole.content]
    assert kinds == ["thinking", "text", "tool_use", "text", "tool_use"]
    assert whole.content[0] == {"type": "thinking", "thinking": "Think.", "signature": ""}
    assert whole.content[2]["input"] == {"expression": "2+2"}
    assert whole.content[2]["id"].startswith("toolu_")


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_the_sdk_accumulates_the_events_into_the_served_blocks(cuts):
    content, events = _streamed(TEXT, cuts)
    head = {"id": "msg-1", "type": "message", "role": "assistant", "model": "m", "content": []}
    start = {"type": "message_start", "message": {**head, "usage": USAGE}}
    snapshot, buffers = None, {}
    for event in [start, *events]:
        parsed = EVENT.validate_python(event)
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    assert [block.model_dump(exclude_none=True) for block in snapshot.content] == content


def test_malformed_tool_call_text_stays_text():
    broken = '<tool_call>\n{"name": "calculator", "arguments": {oops}\n</tool_call>'
    blocks = _Blocks()
    blocks.push(_events(None, broken, NAMES))
    assert blocks.content == [{"type": "text", "text": broken}]


def test_the_conversation_becomes_the_templates_messages():
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "2+2?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "add", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "calc", "input": {"e": "2+2"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "4"},
                        {"type": "text", "text": "So?"},
                    ],
                },
                {"role": "assistant", "content": "It is"},
            ],
            "tools": [{"name": "calc", "input_schema": {"type": "object"}}],
        }
    )
    messages, tools, prefill = conversation(body)
    call = {
        "id": "t1",
        "type": "function",
        "function": {"name": "calc", "arguments": '{"e": "2+2"}'},
    }
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "add"},
        {"role": "tool", "tool_call_id": "t1", "content": "4"},
        {"role": "user", "content": "So?"},
    ]
    assert tools == [
        {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    ]
    assert prefill == "It is"


def _turn(index: int, messages: list, content: list) -> TurnOut:
    response = {"role": "assistant", "content": content, "stop_reason": "end_turn"}
    return turn_out(index, surface="messages", model="claude", messages=messages, response=response)


def test_the_transcript_shows_anthropic_turns_in_chat_form():
    asked = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    use = {"type": "tool_use", "id": "t", "name": "calc", "input": {"e": "2+2"}}
    reply = [{"type": "text", "text": "Adding."}, use]
    # The client sends the blocks back with fields of its own (citations: null).
    sent_back = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Adding.", "citations": None}, use],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "4"}],
    }
    entries = transcript([_turn(0, asked, reply), _turn(1, [*asked, sent_back, result], [])])
    assert entries[0].messages == asked
    assert entries[0].reply == {
        "role": "assistant",
        "content": "Adding.",
        "tool_calls": [{"name": "calc", "input": {"e": "2+2"}}],
    }
    assert entries[1].hidden == 3
    assert entries[1].messages == [{"role": "tool", "content": "4"}]
    assert json.dumps(entries[1].reply)  # shown, even when empty


def test_every_status_of_the_error_table_has_one_of_anthropics_error_types():
    from typing import get_args

    from anthropic.types.shared import ErrorObject

    from server.errors import RENDERING
    from server.proxy.anthropic_schemas import anthropic_body, anthropic_type

    union = get_args(get_args(ErrorObject)[0])
    anthropic_types = {get_args(kind.model_fields["type"].annotation)[0] for kind in union}
    # Documented (docs.claude.com/en/api/errors: "413 - request_too_large") though the SDK's
    # union leaves it out: Anthropic's edge answers it before the API does.
    anthropic_types.add("request_too_large")
    for rendering in RENDERING.values():
        assert anthropic_type(rendering.status) in anthropic_types, rendering
    assert [anthropic_type(s) for s in (400, 409, 503, 502, 413)] == [
        "invalid_request_error",
        "invalid_request_error",
        "overloaded_error",
        "api_error",
        "request_too_large",
    ]
    body = anthropic_body("max_tokens: too many", 400, "max_tokens")
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: too many"},
    }
    assert anthropic_body("Too long.", 400, "messages")["error"]["message"] == (
        "Too long. (at messages)"
    )


def test_anthropic_paths_are_the_messages_routes_under_v1_and_a_session():
    from server.proxy.anthropic_schemas import is_anthropic_path

    for path in ("/v1/messages", "/v1/messages/count_tokens", "/sessions/s-1/v1/messages"):
        assert is_anthropic_path(path), path
    assert is_anthropic_path("/sessions/s-1/v1/messages/count_tokens")
    for path in ("/v1/messagesx", "/v1/chat/completions", "/sessions/s-1/v1/responses", "/"):
        assert not is_anthropic_path(path), path
    assert not is_anthropic_path("/sessions/v1/messages") and not is_anthropic_path("/sessions/")


def test_an_error_in_the_stream_is_anthropics_error_event_and_nothing_follows():
    from server.errors import EngineUnavailable
    from server.proxy.answer import frame

    renderer = MessagesRenderer.__new__(MessagesRenderer)  # error and closing need no state
    events = frame(renderer, renderer.error(EngineUnavailable("it went away")))
    name, data = events.strip().split("\n")
    assert name == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "it went away" in body["error"]["message"]
    assert frame(renderer, renderer.closing()) == ""
