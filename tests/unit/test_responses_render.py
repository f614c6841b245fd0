"""The Responses API's renderer driven the way ``answer`` drives it, token by token, on model
texts mixing prose and tool calls: every event is one of the openai SDK's types, numbered in
order; the items the events build are the Response's output, which is what the turn records;
calls keep the ids they were streamed with; the answer not streamed has the same items."""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from server.common.tiny_model import create_tiny_model
from server.engine_client.client import Piece
from server.errors import EngineUnavailable
from server.proxy import outputs
from server.proxy.generation import Completion, SamplingRequest
from server.proxy.plan import new_plan
from server.proxy.prompts import Prompt
from server.proxy.responses_render import ResponsesRenderer
from server.proxy.responses_schema import ResponseRequest
from server.text.tokenization import Tokenizer

EVENTS = {
    get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in get_args(get_args(ResponseStreamEvent)[0])
}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
TEXTS = {
    "prose": "The answer is 4.",
    "a call": CALL,
    "prose then a call": "Let me compute.\n" + CALL,
    "a call then prose": CALL + "\nDone.",
    "two calls around prose": CALL + "\nand\n" + CALL.replace("2+2", "3*5"),
    "a malformed call stays text": "<tool_call>\n{not json}\n</tool_call> ok",
    "an unknown tool stays text": CALL.replace("calculator", "search"),
    "a call never closed": "<tool_call>\n{",
    "a held-back marker at the end": "Almost <tool_c",
    "nothing": "",
}


REASONED = {
    "reasoning then prose": "<think>\nTwo and two.\n</think>\n\nThe answer is 4.",
    "reasoning then a call": "<think>\nA tool.\n</think>\n\n" + CALL,
    "reasoning never closed": "<think>\nStill thinking",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reasoning_tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("reasoning") / "tiny"
    return Tokenizer.from_pretrained(create_tiny_model(path, "tiny", template="reasoning"))


def renderer_for(tokenizer: Tokenizer, limit: int) -> ResponsesRenderer:
    tool = {"type": "function", "name": "calculator", "parameters": {"type": "object"}}
    body = ResponseRequest.model_validate({"model": "m", "input": "hi", "tools": [tool]})
    plan = new_plan(
        "resp",
        Prompt([1, 2, 3], None),
        SamplingRequest(prompt_ids=[1, 2, 3], max_tokens=limit),
        1,
        surface="responses",
        model="m",
        tool_names={"calculator"},
    )
    return ResponsesRenderer(
        SimpleNamespace(tokenizer=tokenizer, model_name="tiny", metrics=None), plan, body
    )  # type: ignore[arg-type]


def completion_of(ids: list[int], reason: str) -> Completion:
    count = len(ids)
    return Completion([1, 2, 3], ids, [-0.5] * count, [], [0] * count, {"type": reason})


def stream(tokenizer: Tokenizer, text: str, reason: str = "stop") -> tuple[list[dict], dict]:
    """The events and the recorded Response of ``text`` streamed one token at a time."""
    ids = tokenizer.encode(text)
    renderer = renderer_for(tokenizer, max(len(ids), 1))
    choice = outputs.ChoiceText(tokenizer, (), {"calculator"}, reasoning=True)
    events = []
    for token in ids:
        events += renderer.delta(0, choice.push([token]), Piece(ids=[token], logprobs=[-0.5]))
    completion = completion_of(ids, reason)
    served = renderer.served(renderer.plan.completion_ids[0], completion)
    tail = renderer.finish(0, choice.finish(completion), served.finish_reason)
    events = [*renderer.start(), *events, *tail, *renderer.end({})]
    return events, served.response


def built_items(events: list[dict]) -> list[dict]:
    """The output items as a client assembles them from the events."""
    done = {e["output_index"]: e["item"] for e in events if e["type"].endswith("item.done")}
    added = [e["output_index"] for e in events if e["type"].endswith("item.added")]
    assert added == list(range(len(added))) and sorted(done) == added
    return [done[index] for index in added]


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_the_stream_builds_the_response_that_is_recorded(tokenizer, text):
    events, response = stream(tokenizer, text)
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    Response.model_validate(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1] == {
        "type": "response.completed",
        "sequence_number": len(events) - 1,
        "response": response,
    }
    assert built_items(events) == response["output"]
    for index, item in enumerate(response["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        if item["type"] == "message":
            deltas = [e["delta"] for e in mine if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == item["content"][0]["text"]
        else:
            (arguments,) = [e for e in mine if e["type"].endswith("arguments.done")]
            assert arguments["arguments"] == item["arguments"]


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_streamed_and_whole_answers_hold_the_same_text_and_calls(tokenizer, text):
    _, streamed = stream(tokenizer, text)
    renderer = renderer_for(tokenizer, 1000)
    ids = tokenizer.encode(text)
    whole = renderer.served("resp_x", completion_of(ids, "stop")).response

    def essence(output: list[dict]) -> tuple:
        text = "".join(i["content"][0]["text"] for i in output if i["type"] == "message")
        calls = [(i["name"], i["arguments"]) for i in output if i["type"] == "function_call"]
        return text, calls

    assert essence(streamed["output"]) == essence(whole["output"])
    calls = sum(i["type"] == "function_call" for i in whole["output"])
    assert calls == text.count('"name": "calculator"')


def test_a_call_keeps_the_id_it_was_streamed_with_and_length_is_incomplete(tokenizer):
    events, response = stream(tokenizer, "Let me compute.\n" + CALL + " and", reason="length")
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    (added,) = [item for item in added if item["type"] == "function_call"]
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert (added["id"], added["call_id"]) == (call["id"], call["call_id"])
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("text", REASONED.values(), ids=REASONED.keys())
def test_reasoning_is_a_reasoning_item_streamed_first(reasoning_tokenizer, text):
    events, response = stream(reasoning_tokenizer, text)
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    Response.model_validate(response)
    assert built_items(events) == response["output"]
    reasoning, *rest = response["output"]
    assert reasoning["type"] == "reasoning" and rest
    thought = text.removeprefix("<think>\n").split("\n</think>")[0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": thought}]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    assert all("<think>" not in str(item) for item in rest)


def test_an_error_in_the_stream_is_openais_error_event_and_ends_it(tokenizer):
    renderer = renderer_for(tokenizer, 4)
    (event,) = renderer.error(EngineUnavailable("it broke off"))
    EVENTS["error"].model_validate(event)
    assert event["sequence_number"] == 2  # after response.created and response.in_progress
    assert event["code"] == "engine_unavailable" and "it broke off" in event["message"]
    assert renderer.closing() == []  # no [DONE] in a Responses stream
