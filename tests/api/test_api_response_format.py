"""Structured output (Chat Completions' ``response_format``, the Responses API's ``text.format``)
by the run's ``response_format`` policy, set as users set it (``PATCH /rl/runs/{id}``), through
the real ``openai`` SDK in-process: ``refuse`` (the default, also for requests in the default
run) answers 400 in OpenAI's shape with nothing stored; ``unconstrained`` serves the request
sampled as any answer, says so in a header, and stores exactly the sampled tokens and their
logprobs. ``text`` is always served; an unknown type always refused."""

from __future__ import annotations

import openai
import pytest

from server.proxy.plan import RESPONSE_FORMAT_HEADER
from tests.api.api_support import Api, assert_error, streamed_chat

MODEL = "gpt-5.6-luna"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
CHAT_FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {
        "type": "json_schema",
        "json_schema": {"name": "sum", "schema": SCHEMA, "strict": True},
    },
}
RESPONSE_FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "name": "sum", "schema": SCHEMA, "strict": True},
}
QUESTION = [{"role": "user", "content": "What is 2 + 3? Answer in JSON."}]


UNCONSTRAINED = {"response_format": "unconstrained"}
TASK = "response-format"


def turns(api: Api, session: dict) -> list[dict]:
    return api.session(session["session_id"])["turns"]


def served_unconstrained(api: Api, session: dict, raw, usage: tuple[int, int]) -> dict:
    """The answer (``raw``: the SDK's raw response) says it was sampled unconstrained, and
    ``usage`` (prompt, completion tokens served) counts the session's one turn; the turn."""
    assert raw.headers[RESPONSE_FORMAT_HEADER] == "unconstrained"
    (turn,) = turns(api, session)
    assert usage == (len(turn["prompt_ids"]), len(turn["completion_ids"]))
    return turn


@pytest.mark.parametrize("policy", [None, "refuse"])
@pytest.mark.parametrize("kind", sorted(CHAT_FORMATS))
def test_a_run_that_refuses_structured_output_answers_400_on_both_surfaces(
    api: Api, policy: str | None, kind: str
):
    session = api.session_of_run({"response_format": policy} if policy else None, task_id=TASK)
    sdk = api.openai(session["api_key"])
    with pytest.raises(openai.BadRequestError) as chat:
        sdk.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, response_format=CHAT_FORMATS[kind]
        )
    with pytest.raises(openai.BadRequestError) as responses:
        sdk.responses.create(
            model=MODEL,
            input="What is 2 + 3?",
            max_output_tokens=4,
            text={"format": RESPONSE_FORMATS[kind]},
        )
    for caught, param in ((chat, "response_format"), (responses, "text.format")):
        error = caught.value.body
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] == param and "unconstrained" in error["message"]
    assert turns(api, session) == []


def test_a_session_of_the_default_run_called_without_a_key_gets_the_default_policy(api: Api):
    """A session made without a run is the default run's; called on its path with no key, its
    structured output is refused (the default policy)."""
    session = api.new_session(task_id="response-format-default")
    reply = api.call(
        "POST",
        f"/sessions/{session['session_id']}/v1/chat/completions",
        key=None,
        json={
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 2,
            "response_format": {"type": "json_object"},
        },
    )
    assert assert_error(reply, 400)["param"] == "response_format"
    assert turns(api, session) == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", sorted(CHAT_FORMATS))
def test_an_unconstrained_run_serves_chat_structured_output_sampled_as_any_answer(
    api: Api, kind: str, stream: bool
):
    session = api.session_of_run(UNCONSTRAINED, task_id=TASK)
    sdk = api.openai(session["api_key"])
    request = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 6,
        "logprobs": True,
        "response_format": CHAT_FORMATS[kind],
    }
    if stream:
        raw = sdk.chat.completions.with_raw_response.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(raw.parse())
        content, logprobs = streamed_chat(chunks)
        usage = chunks[-1].usage
    else:
        raw = sdk.chat.completions.with_raw_response.create(**request)
        answer = raw.parse()
        content = answer.choices[0].message.content or ""
        logprobs = [e.logprob for e in answer.choices[0].logprobs.content or []]
        usage = answer.usage
    turn = served_unconstrained(api, session, raw, (usage.prompt_tokens, usage.completion_tokens))
    assert turn["response"]["content"] == content
    assert logprobs == turn["logprobs"]  # the policy's, unconstrained


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", sorted(RESPONSE_FORMATS))
def test_an_unconstrained_run_serves_a_structured_response_and_echoes_its_format(
    api: Api, kind: str, stream: bool
):
    session = api.session_of_run(UNCONSTRAINED, task_id=TASK)
    sdk = api.openai(session["api_key"])
    request = {
        "model": MODEL,
        "input": "What is 2 + 3?",
        "max_output_tokens": 6,
        "text": {"format": RESPONSE_FORMATS[kind]},
    }
    if stream:
        raw = sdk.responses.with_raw_response.create(**request, stream=True)
        response = list(raw.parse())[-1].response
    else:
        raw = sdk.responses.with_raw_response.create(**request)
        response = raw.parse()
    usage = (response.usage.input_tokens, response.usage.output_tokens)
    turn = served_unconstrained(api, session, raw, usage)
    assert response.text.format.type == kind
    assert turn["response"]["text"] == {"format": RESPONSE_FORMATS[kind]}


def test_text_is_always_served_without_the_header(api: Api):
    session = api.session_of_run(task_id=TASK)
    sdk = api.openai(session["api_key"])
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=2, response_format={"type": "text"}
    )
    assert RESPONSE_FORMAT_HEADER not in raw.headers
    raw = sdk.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, text={"format": {"type": "text"}}
    )
    assert RESPONSE_FORMAT_HEADER not in raw.headers
    assert len(turns(api, session)) == 2


BAD_FORMATS = {
    "an unknown chat type": ("/v1/chat/completions", {"response_format": {"type": "grammar"}}),
    "a chat json_schema without its object": (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema"}},
    ),
    "an unknown responses type": ("/v1/responses", {"text": {"format": {"type": "grammar"}}}),
    "a responses json_schema without a schema": (
        "/v1/responses",
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FORMATS))
def test_a_malformed_or_unknown_format_is_refused_even_unconstrained(api: Api, case: str):
    session = api.session_of_run(UNCONSTRAINED, task_id=TASK)
    path, extra = BAD_FORMATS[case]
    body = (
        {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
        if path.endswith("completions")
        else {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    )
    reply = api.call("POST", path, key=session["api_key"], json=body | extra)
    param = assert_error(reply, 400)["param"]
    assert param.startswith("response_format" if path.endswith("completions") else "text.format")
    assert turns(api, session) == []


def test_a_bad_policy_is_refused_by_the_run_config(api: Api):
    run = api.new_run()
    reply = api.call(
        "PATCH", f"/rl/runs/{run['id']}", json={"config": {"response_format": "constrained"}}
    )
    assert reply.status_code in (400, 422), reply.text
