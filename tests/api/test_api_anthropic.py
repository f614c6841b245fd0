"""Anthropic's Messages API in-process: a message and its event stream (each checked against
the ``anthropic`` SDK's own types), the key as ``x-api-key`` or a bearer token, the session path
form, ``count_tokens``, tool results in the prompt, and bad input on each field refused with a
400 in Anthropic's error shape with nothing stored."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from tests.api.api_support import ADMIN_KEY, NO_KEY, Api

MODEL = "claude-haiku-4-5"  # any name is served; the turn records it
VERSION = {"anthropic-version": "2023-06-01"}
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def ask(text: str = "Tell me about numbers.", **body) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": [user(text)], **body}


def post(api: Api, session: dict, body: dict, path: str = "/v1/messages", **headers):
    """A call with the session key in ``x-api-key``, as Anthropic's clients send it."""
    headers = {"x-api-key": session["api_key"], **VERSION, **headers}
    return api.call("POST", path, key=NO_KEY, json=body, headers=headers)


def turns(api: Api, session: dict) -> list[dict]:
    return api.session(session["session_id"])["turns"]


def assert_anthropic_error(reply, status: int, kind: str) -> str:
    """An error in Anthropic's shape (parsed by the SDK's type); its message."""
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, body
    error = ErrorResponse.model_validate(body).error
    assert error.type == kind and error.message, body
    return error.message


def named_events(reply) -> list[dict]:
    """The SSE blocks of a stream: each an ``event:`` line naming the ``data:`` line's type."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in reply.text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}", block
        events.append(payload)
    return events


def test_a_message_is_answered_in_anthropics_shape_and_stored(api: Api):
    session = api.new_session(task_id="anthropic")
    body = ask(system="You count.", stop_sequences=["\n\n"], temperature=0.5)
    reply = post(api, session, body)
    assert reply.status_code == 200, reply.text
    message = Message.model_validate(reply.json())

    (turn,) = turns(api, session)
    assert message.id == turn["completion_id"] and message.model == api.model_dir.name
    assert (turn["surface"], turn["model"]) == ("messages", MODEL)
    assert turn["messages"] == [
        {"role": "system", "content": "You count."},
        user(body["messages"][0]["content"]),
    ]
    assert turn["response"]["content"] == reply.json()["content"]
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert (message.stop_reason == "max_tokens") == (turn["finish_reason"] == "length")
    assert message.usage.input_tokens == len(turn["prompt_ids"])
    assert message.usage.output_tokens == len(turn["completion_ids"]) <= 8
    assert turn["sampling"]["temperature"] == 0.5 and turn["sampling"]["stop"] == ["\n\n"]
    assert "".join(b.text for b in message.content if b.type == "text") == api_text(api, turn)


def api_text(api: Api, turn: dict) -> str:
    """The text of a turn's completion, as the proxy decodes it (stop token cut)."""
    from server.text.tokenization import Tokenizer

    text = Tokenizer.from_pretrained(api.model_dir).decode(turn["completion_ids"])
    return text if turn["response"]["stop_sequence"] is None else text.split("\n\n")[0]


def test_a_streamed_message_is_anthropics_event_sequence_adding_up_to_the_turn(api: Api):
    session = api.new_session(task_id="anthropic-stream")
    reply = post(api, session, ask("Tell me a story.", max_tokens=16, stream=True))
    events = named_events(reply)
    for event in events:
        if event["type"] != "ping":  # the SDK reads pings apart from the message's events
            STREAM_EVENT.validate_python(event)
    (turn,) = turns(api, session)

    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["id"] == turn["completion_id"] and start["content"] == []
    assert start["usage"]["input_tokens"] == len(turn["prompt_ids"])
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    blocks = turn["response"]["content"]
    assert text == "".join(block["text"] for block in blocks)
    if text:
        assert kinds[2] == "content_block_start" and kinds[-3] == "content_block_stop"
        assert len(blocks) == 1 and kinds.count("content_block_start") == 1
    end = events[-2]
    assert end["delta"]["stop_reason"] == turn["response"]["stop_reason"]
    assert end["usage"]["output_tokens"] == len(turn["completion_ids"])


def test_the_key_is_taken_as_x_api_key_or_bearer_and_the_path_form_works(api: Api):
    session = api.new_session(task_id="anthropic-keys")
    assert post(api, session, ask()).status_code == 200
    bearer = api.call("POST", "/v1/messages", key=session["api_key"], json=ask())
    assert bearer.status_code == 200, bearer.text
    path = f"/sessions/{session['session_id']}/v1/messages"
    fixed_key = api.call("POST", path, key=NO_KEY, json=ask(), headers={"x-api-key": "sk-ant-x"})
    assert fixed_key.status_code == 200, fixed_key.text
    assert len(turns(api, session)) == 3


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "not-a-key-proxrl-issued"}])
def test_no_key_or_an_unknown_key_is_a_401_in_anthropics_shape(api: Api, headers: dict):
    reply = api.call("POST", "/v1/messages", key=NO_KEY, json=ask(), headers=headers)
    assert_anthropic_error(reply, 401, "authentication_error")


def test_count_tokens_counts_the_prompt_a_message_would_sample(api: Api):
    session = api.new_session(task_id="anthropic-count")
    body = ask("Count these tokens.", system=[{"type": "text", "text": "Be brief."}])
    counted = post(api, session, body, "/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.text
    count = MessageTokensCount.model_validate(counted.json())
    assert turns(api, session) == []  # counting records nothing
    post(api, session, body)
    (turn,) = turns(api, session)
    assert count.input_tokens == len(turn["prompt_ids"])


def test_tool_use_and_tool_result_blocks_render_into_the_models_template(api: Api):
    session = api.new_session(task_id="anthropic-tools")
    tool = {"name": "calculator", "description": "Add.", "input_schema": {"type": "object"}}
    messages = [
        user("What is 2+2?"),
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me add."},
                {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"a": "2+2"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"},
                {"type": "text", "text": "Go on."},
            ],
        },
    ]
    post(api, session, ask(messages=messages, tools=[tool]))
    (turn,) = turns(api, session)
    from server.text.tokenization import Tokenizer

    prompt = Tokenizer.from_pretrained(api.model_dir).decode(turn["prompt_ids"], False)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"a": "2+2"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>" in prompt
    assert "<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert '"name": "calculator", "description": "Add."' in prompt
    assert turn["tools"] == [tool] and turn["messages"] == messages
    page = api.call("GET", f"/admin/sessions/{session['session_id']}")  # the transcript
    assert page.status_code == 200 and "Let me add." in page.text and "calculator" in page.text
    assert "Go on." in page.text and "[{" not in page.text  # blocks shown as chat, not raw


def test_a_final_assistant_message_is_continued(api: Api):
    session = api.new_session(task_id="anthropic-prefill")
    messages = [user("Count."), {"role": "assistant", "content": "One, two,"}]
    post(api, session, ask(messages=messages))
    (turn,) = turns(api, session)
    from server.text.tokenization import Tokenizer

    prompt = Tokenizer.from_pretrained(api.model_dir).decode(turn["prompt_ids"], False)
    assert prompt.endswith("<|im_start|>assistant\nOne, two,")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "calculator"}])
def test_a_forced_tool_call_starts_the_answer_inside_a_call(api: Api, choice: dict, stream: bool):
    """tool_choice any or a named tool: the prompt ends with the start of a call (sampled tokens
    stay sampled); the answer is read for calls from that start, and what the tiny model writes
    after it is served as a call, or as text when it is no call."""
    session = api.new_session(task_id="anthropic-forced")
    tool = {"name": "calculator", "input_schema": {"type": "object"}}
    body = ask(tools=[tool], tool_choice=choice, stream=stream, max_tokens=12)
    reply = post(api, session, body)
    (turn,) = turns(api, session)
    from server.text.tokenization import Tokenizer

    tokenizer = Tokenizer.from_pretrained(api.model_dir)
    start = (
        "<tool_call>\n"
        if choice["type"] == "any"
        else '<tool_call>\n{"name": "calculator", "arguments":'
    )
    assert tokenizer.decode(turn["prompt_ids"], False).endswith("<|im_start|>assistant\n" + start)
    counted = post(api, session, body, "/v1/messages/count_tokens").json()
    assert counted["input_tokens"] == len(turn["prompt_ids"])
    blocks = turn["response"]["content"]
    if stream:
        events = named_events(reply)
        streamed = "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )
        assert streamed == "".join(b.get("text", "") for b in blocks)
    else:
        assert reply.json()["content"] == blocks
    completion = tokenizer.decode(turn["completion_ids"])
    if turn["response"]["stop_reason"] == "tool_use":
        assert [b["name"] for b in blocks if b["type"] == "tool_use"] == ["calculator"]
    else:
        assert blocks == [{"type": "text", "text": (start + completion).strip()}]


def test_max_tokens_beyond_the_context_is_cut_to_it_with_its_stop_reason(api: Api):
    """Claude's clients ask for many more tokens than a small model's context holds: the answer
    is cut where the context ends, and says so (stop_reason model_context_window_exceeded)."""
    session = api.new_session(task_id="anthropic-context")
    words, room = 2000, 3  # a prompt that leaves ``room`` tokens of the 2048-token context
    for _ in range(5):
        body = ask("hello " * words, max_tokens=100_000, stop_sequences=["no such stop"])
        count = post(api, session, body, "/v1/messages/count_tokens").json()["input_tokens"]
        if count == 2048 - room:
            break
        words -= count - (2048 - room)
    assert count == 2048 - room
    message = Message.model_validate(post(api, session, body).json())
    (turn,) = turns(api, session)
    assert turn["sampling"]["max_tokens"] == room
    cut = turn["finish_reason"] == "length"  # else the model ended its answer in time
    assert message.stop_reason == ("model_context_window_exceeded" if cut else "end_turn")


def image(kind: str = "image") -> dict:
    return {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


BAD = {
    "no max_tokens": ({"model": MODEL, "messages": [user("hi")]}, "max_tokens"),
    "no messages": ({"model": MODEL, "max_tokens": 8}, "messages"),
    "no model": ({"max_tokens": 8, "messages": [user("hi")]}, "model"),
    "empty messages": (ask(messages=[]), "messages"),
    "a role of no message": (ask(messages=[{"role": "developer", "content": "x"}]), "role"),
    "content of a wrong type": (ask(messages=[{"role": "user", "content": 3}]), "content"),
    "a block whose type is not a string": (
        ask(messages=[{"role": "user", "content": [{"type": {}}]}]),
        "content",
    ),
    "a block that is not an object": (ask(messages=[{"role": "user", "content": [3]}]), "content"),
    "an image": (ask(messages=[{"role": "user", "content": [image()]}]), "'image'"),
    "a document": (ask(messages=[{"role": "user", "content": [image("document")]}]), "'document'"),
    "an image in a tool result": (
        ask(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image()]}],
                }
            ]
        ),
        "'image'",
    ),
    "tool_use from the user": (
        ask(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        ),
        "tool_use",
    ),
    "a server tool": (
        ask(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "web_search",
    ),
    "tool_choice any without tools": (ask(tool_choice={"type": "any"}), "tool_choice"),
    "a tool_choice naming no tool": (
        ask(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "g"}),
        "tool_choice",
    ),
    "a forced call after a prefill": (
        ask(
            messages=[user("x"), {"role": "assistant", "content": "Sure"}],
            tools=[{"name": "f", "input_schema": {}}],
            tool_choice={"type": "any"},
        ),
        "tool_choice",
    ),
    "an unknown tool_choice": (ask(tool_choice={"type": "sometimes"}), "tool_choice"),
    "max_tokens 0": (ask(max_tokens=0), "max_tokens"),
    "max_tokens a string": (ask(max_tokens="many"), "max_tokens"),
    "temperature above 1": (ask(temperature=1.5), "temperature"),
    "top_p below 1": (ask(top_p=0.5), "top_p"),
    "top_k": (ask(top_k=5), "top_k"),
    "stop_sequences a string": (ask(stop_sequences="\n"), "stop_sequences"),
    "an empty stop sequence": (ask(stop_sequences=[""]), "stop_sequences"),
    "system a number": (ask(system=5), "system"),
    "a prompt longer than the context": (ask("hello " * 5000), "context"),
    "a tool_use left unanswered": (
        ask(
            messages=[
                user("x"),
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                },
            ]
        ),
        "tool_result",
    ),
}


SAMPLING = {
    "no max_tokens",
    "max_tokens 0",
    "max_tokens a string",
    "temperature above 1",
    "top_p below 1",
    "top_k",
    "stop_sequences a string",
    "an empty stop sequence",
    "a prompt longer than the context",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_in_anthropics_shape_and_nothing_is_stored(api: Api, case: str):
    session = api.new_session(task_id="anthropic-bad")
    body, named = BAD[case]
    paths = ["/v1/messages"]
    if case not in SAMPLING:  # count_tokens takes the prompt's fields only
        paths.append("/v1/messages/count_tokens")
    for path in paths:
        message = assert_anthropic_error(
            post(api, session, body, path), 400, "invalid_request_error"
        )
        assert named in message, message
    assert turns(api, session) == []


def test_a_body_that_is_not_json_and_an_unknown_session_answer_in_anthropics_shape(api: Api):
    session = api.new_session(task_id="anthropic-framework")
    headers = {"x-api-key": session["api_key"], "content-type": "application/json"}
    reply = api.call("POST", "/v1/messages", key=NO_KEY, content=b"{not json", headers=headers)
    assert_anthropic_error(reply, 400, "invalid_request_error")
    missing = api.call("POST", "/sessions/no-such-session/v1/messages", key=NO_KEY, json=ask())
    assert_anthropic_error(missing, 404, "not_found_error")
    admin = api.call("POST", "/v1/messages", key=ADMIN_KEY, json=ask())
    assert_anthropic_error(admin, 400, "invalid_request_error")  # which session: not named
    assert turns(api, session) == []


def test_an_ended_session_is_a_409_in_anthropics_shape(api: Api):
    session = api.new_session(task_id="anthropic-ended")
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    assert_anthropic_error(post(api, session, ask()), 409, "invalid_request_error")


def test_the_api_document_gives_anthropics_error_shape_on_its_routes_only(api: Api):
    document = api.ok("GET", "/openapi.json", key=NO_KEY)
    anthropic_ref = "#/components/schemas/AnthropicErrorBody"
    for path in ("/v1/messages", "/sessions/{session_id}/v1/messages/count_tokens"):
        responses = document["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": anthropic_ref}, (path, status, schema)
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert chat["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
