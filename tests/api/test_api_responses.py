"""The Responses API in-process: POST /v1/responses streamed and not, its answers and events
validated with the openai SDK's own types; chaining by previous_response_id on one training
row; GET and DELETE; bad input on each field refused in OpenAI's shape with nothing stored."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.api.api_support import Api, assert_error

MODEL = "gpt-5.6-luna"  # any name is served (the answer names the served one, "tiny")
# The SDK's type of each event, by its ``type``.
EVENTS = {
    get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in get_args(get_args(ResponseStreamEvent)[0])
}


def create(api: Api, session: dict, status: int = 200, **body) -> dict:
    request = {"model": MODEL, "input": "Tell me about numbers.", "max_output_tokens": 6, **body}
    return api.ok("POST", "/v1/responses", status, key=session["api_key"], json=request)


def refused(api: Api, session: dict, status: int = 400, code: str | None = None, **body):
    request = {"model": MODEL, "max_output_tokens": 4, **body}
    reply = api.call("POST", "/v1/responses", key=session["api_key"], json=request)
    return assert_error(reply, status, code=code)


def named_events(text: str) -> list[dict]:
    """The events of a Responses stream: each block ``event: <type>`` then one ``data:`` line."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def turns(api: Api, session: dict) -> list[dict]:
    return api.session(session["session_id"])["turns"]


def test_a_response_is_answered_in_openais_shape_and_stored_token_for_token(api: Api):
    session = api.new_session(task_id="responses")
    body = create(api, session, instructions="Be brief.", metadata={"k": "v"}, temperature=0.5)

    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == "tiny" and response.status in ("completed", "incomplete")
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"}
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    (turn,) = turns(api, session)
    assert (turn["completion_id"], turn["surface"], turn["model"]) == (
        body["id"],
        "responses",
        MODEL,
    )
    assert turn["messages"] == [
        {"type": "message", "role": "user", "content": "Tell me about numbers."}
    ]
    assert turn["response"] == body
    assert turn["sampling"]["temperature"] == 0.5
    usage = body["usage"]
    assert usage["input_tokens"] == len(turn["prompt_ids"])
    assert usage["output_tokens"] == len(turn["completion_ids"]) <= 6
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert api.ok("GET", f"/v1/responses/{body['id']}", key=session["api_key"]) == body


def test_a_streamed_response_is_openais_event_sequence_and_what_is_stored(api: Api):
    session = api.new_session(task_id="responses-stream")
    request = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 12, "stream": True}
    reply = api.call("POST", "/v1/responses", key=session["api_key"], json=request)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-")
    events = named_events(reply.text)
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    kinds = [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed"
        if events[-1]["response"]["status"] == "completed"
        else "response.incomplete",
    ]
    deltas = [event["delta"] for event in events if event["type"] == "response.output_text.delta"]
    assert len(deltas) > 1, "token by token, not the whole text at the end"
    (turn,) = turns(api, session)
    final = events[-1]["response"]
    assert turn["response"] == final and final["id"] == turn["completion_id"]
    assert "".join(deltas) == final["output"][0]["content"][0]["text"]
    assert events[-2]["item"] == final["output"][0]
    assert final["usage"]["output_tokens"] == len(turn["completion_ids"])


def test_previous_response_id_rebuilds_the_conversation_on_the_same_row(api: Api):
    session = api.new_session(task_id="responses-chain")
    first = create(api, session, instructions="Be brief.")
    second = create(
        api,
        session,
        input=[{"role": "user", "content": "And then?"}],
        previous_response_id=first["id"],
        instructions="Be brief.",
    )
    third = create(
        api,
        session,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "More."}],
            }
        ],
        previous_response_id=second["id"],
        instructions="Be brief.",
    )
    assert third["previous_response_id"] == second["id"]
    one, two, three = turns(api, session)
    assert [t["row_index"] for t in (one, two, three)] == [0, 0, 0]
    assert two["extends_previous"] and three["extends_previous"]
    assert two["prompt_ids"][: len(one["prompt_ids"]) + len(one["completion_ids"])] == (
        one["prompt_ids"] + one["completion_ids"]
    )
    assert three["messages"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]}
    ]
    assert api.session(session["session_id"])["breaks"] == 0


def test_function_call_items_render_into_the_template_as_a_tool_exchange(api: Api):
    session = api.new_session(task_id="responses-tools")
    tool = {"type": "function", "name": "calculator", "parameters": {"type": "object"}}
    items = [
        {"role": "user", "content": "What is 2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "add"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "calculator",
            "arguments": '{"expression": "2+2"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
    ]
    body = create(api, session, input=items, tools=[tool], tool_choice="auto")
    Response.model_validate(body)
    assert body["tools"] == [tool]
    (turn,) = turns(api, session)
    prompt = api.http.app.state.ctx.tokenizer.decode(turn["prompt_ids"])
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}' in prompt
    assert "<tool_response>\n4\n</tool_response>" in prompt
    assert turn["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "parameters": {"type": "object"},
            },
        }
    ]


def test_store_false_and_deleted_responses_are_not_retrievable_but_stay_for_training(api: Api):
    session = api.new_session(task_id="responses-store")
    key = session["api_key"]
    unstored = create(api, session, store=False)
    kept = create(api, session)
    assert_error(
        api.call("GET", f"/v1/responses/{unstored['id']}", key=key), 404, code="response_not_found"
    )
    deleted = api.ok("DELETE", f"/v1/responses/{kept['id']}", key=key)
    assert deleted == {"id": kept["id"], "object": "response", "deleted": True}
    for gone in (unstored, kept):
        assert_error(api.call("GET", f"/v1/responses/{gone['id']}", key=key), 404)
        error = refused(
            api, session, 404, "response_not_found", input="x", previous_response_id=gone["id"]
        )
        assert error["param"] == "previous_response_id"
    assert_error(api.call("DELETE", f"/v1/responses/{kept['id']}", key=key), 404)
    assert [t["completion_id"] for t in turns(api, session)] == [unstored["id"], kept["id"]]
    path = f"/sessions/{session['session_id']}/v1/responses"
    other = api.new_session(task_id="responses-other")
    assert_error(api.call("GET", f"/v1/responses/{kept['id']}", key=other["api_key"]), 404)
    via_path = api.ok(
        "POST",
        path,
        key=session["api_key"],
        json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
    )
    assert api.ok("GET", f"{path}/{via_path['id']}", key=key) == via_path


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": 7}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.content",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
        ({"input": [{"type": "function_call_output", "output": "4"}]}, "input.0.call_id"),
        ({"input": "x", "tools": [{"type": "custom"}]}, "tools.0.name"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "top_p": 0.5}, "top_p"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ],
)
def test_bad_input_is_refused_in_openais_shape_with_nothing_stored(api: Api, body, param):
    session = api.new_session(task_id="responses-bad")
    error = refused(api, session, **body)
    assert error["param"] is not None and error["param"].startswith(param), error
    assert turns(api, session) == []


def test_an_unknown_previous_response_or_oversized_prompt_is_refused(api: Api):
    session = api.new_session(task_id="responses-unknown")
    error = refused(
        api, session, 404, "response_not_found", input="x", previous_response_id="resp_nope"
    )
    assert "resp_nope" in error["message"]
    refused(api, session, 400, "context_length_exceeded", input="word " * 100_000)
    assert turns(api, session) == []
