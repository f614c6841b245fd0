"""The OpenAI-compatible routes in-process: chat and text completions, streamed and not, the
session named by key, header or path; every turn read back through GET /rl/sessions/{id}; bad
input refused in OpenAI's shape with nothing stored."""

from __future__ import annotations

import pytest

from server.engine_client.pool import parse_version
from tests.api.api_support import NO_KEY, Api, assert_error, sse_events

MODEL = "tiny"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def only_turn(api: Api, session: dict) -> dict:
    (turn,) = api.session(session["session_id"])["turns"]
    return turn


def test_a_chat_completion_is_answered_and_stored_token_for_token(api: Api):
    # the engine's version: other tests of this proxy may have published weights before
    (engine,) = api.ok("GET", "/admin/engines")
    served = parse_version(engine["weight_version"])  # SGLang's start-up "default" is 0
    session = api.new_session(task_id="chat")
    answer = api.chat(session, "Tell me about numbers.", max_tokens=6, seed=1)

    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    turn = only_turn(api, session)
    assert turn["completion_id"] == answer["id"]
    assert (turn["surface"], turn["model"]) == ("chat", MODEL)
    assert turn["messages"] == [user("Tell me about numbers.")]
    assert turn["response"]["content"] == choice["message"]["content"]
    assert turn["finish_reason"] == choice["finish_reason"]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(turn["prompt_ids"])
    assert usage["completion_tokens"] == len(turn["completion_ids"]) <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(turn["logprobs"]) == len(turn["completion_ids"])
    assert all(logprob <= 0.0 for logprob in turn["logprobs"])
    assert turn["versions"] == [served] * len(turn["completion_ids"])


def test_a_streamed_chat_is_well_formed_chunks_ending_in_usage_then_done(api: Api):
    session = api.new_session(task_id="chat-stream")
    body = {
        "model": MODEL,
        "messages": [user("Tell me a story.")],
        "max_tokens": 12,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=body)
    *chunks, usage_chunk, done = sse_events(reply)
    assert done == "[DONE]"
    turn = only_turn(api, session)

    assert all(isinstance(chunk, dict) for chunk in chunks)
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk["id"] for chunk in [*chunks, usage_chunk]} == {turn["completion_id"]}
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get("content") or "" for delta in deltas) == turn["response"]["content"]
    finishes = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]
    ]
    assert finishes == [turn["finish_reason"]]
    assert isinstance(usage_chunk, dict) and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(turn["completion_ids"])
    assert usage_chunk["usage"]["prompt_tokens"] == len(turn["prompt_ids"])


def test_a_text_completion_is_answered_and_stored(api: Api):
    session = api.new_session(task_id="text")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5}
    answer = api.ok("POST", "/v1/completions", key=session["api_key"], json=body)

    assert answer["object"] == "text_completion"
    (choice,) = answer["choices"]
    turn = only_turn(api, session)
    assert turn["completion_id"] == answer["id"]
    assert (turn["surface"], turn["model"]) == ("completions", MODEL)
    assert turn["response"] == {"text": choice["text"]}
    assert answer["usage"]["completion_tokens"] == len(turn["completion_ids"]) <= 5
    assert answer["usage"]["prompt_tokens"] == len(turn["prompt_ids"])


def test_a_streamed_text_completion_adds_up_to_the_stored_text_then_done(api: Api):
    session = api.new_session(task_id="text-stream")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "stream": True}
    reply = api.call("POST", "/v1/completions", key=session["api_key"], json=body)
    *chunks, done = sse_events(reply)
    assert done == "[DONE]" and chunks
    turn = only_turn(api, session)
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert {chunk["id"] for chunk in chunks} == {turn["completion_id"]}
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == turn["response"]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == turn["finish_reason"]


def test_a_second_turn_that_repeats_the_first_continues_its_row(api: Api):
    session = api.new_session(task_id="multi-turn")
    first = api.chat(session, "hello")
    history = [user("hello"), first["choices"][0]["message"], user("and then?")]
    body = {"model": MODEL, "messages": history, "max_tokens": 4}
    api.ok("POST", "/v1/chat/completions", key=session["api_key"], json=body)

    stored = api.session(session["session_id"])
    assert stored["turn_count"] == 2 and stored["row_count"] == 1 and stored["breaks"] == 0
    one, two = stored["turns"]
    assert two["extends_previous"] and two["row_index"] == one["row_index"]
    assert two["prompt_ids"][: len(one["prompt_ids"]) + len(one["completion_ids"])] == (
        one["prompt_ids"] + one["completion_ids"]
    )


@pytest.mark.parametrize("key", [NO_KEY, "an-agents-fixed-key"])
def test_the_session_path_form_takes_any_key_or_none(api: Api, key: str | None):
    session = api.new_session(task_id="path-form")
    path = f"/sessions/{session['session_id']}/v1/chat/completions"
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
    answer = api.ok("POST", path, key=key, json=body)
    assert only_turn(api, session)["completion_id"] == answer["id"]

    models = api.ok("GET", f"/sessions/{session['session_id']}/v1/models", key=key)
    assert [card["id"] for card in models["data"]] == [MODEL]


def test_a_run_key_names_its_session_in_the_header_and_reaches_no_other_run(api: Api):
    run = api.new_run()
    session = api.new_session(run["id"], task_id="header")
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
    headers = {"X-Session-Id": session["session_id"]}
    answer = api.ok("POST", "/v1/chat/completions", key=run["api_key"], json=body, headers=headers)
    assert only_turn(api, session)["completion_id"] == answer["id"]

    elsewhere = api.new_session(task_id="another-run")
    headers = {"X-Session-Id": elsewhere["session_id"]}
    reply = api.call("POST", "/v1/chat/completions", key=run["api_key"], json=body, headers=headers)
    assert_error(reply, 403)
    assert api.session(elsewhere["session_id"])["turns"] == []


def test_a_call_that_names_no_session_is_a_400(api: Api):
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
    assert_error(api.call("POST", "/v1/chat/completions", json=body), 400)


def test_a_session_key_on_another_sessions_path_is_a_403(api: Api):
    mine, theirs = api.new_session(), api.new_session()
    path = f"/sessions/{theirs['session_id']}/v1/chat/completions"
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
    assert_error(api.call("POST", path, key=mine["api_key"], json=body), 403)
    assert api.session(theirs["session_id"])["turns"] == []


def test_an_unknown_session_in_the_path_is_a_404(api: Api):
    path = "/sessions/sess-does-not-exist/v1/chat/completions"
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
    assert_error(api.call("POST", path, key=NO_KEY, json=body), 404, code="session_not_found")
    reply = api.call("GET", "/sessions/sess-does-not-exist/v1/models", key=NO_KEY)
    assert_error(reply, 404, code="session_not_found")


BAD_BODIES = {
    "missing-messages": (b'{"model": "tiny"}', 400, "messages"),
    "messages-as-a-string": (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    "temperature-as-a-word": (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
        400,
        "temperature",
    ),
    "untrainable-top-p": (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}',
        400,
        "top_p",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_bad_chat_body_is_a_4xx_naming_what_to_fix_and_stores_nothing(api: Api, case: str):
    content, status, param = BAD_BODIES[case]
    session = api.new_session(task_id=f"bad-{case}")
    headers = {"Content-Type": "application/json"}
    reply = api.call(
        "POST", "/v1/chat/completions", key=session["api_key"], content=content, headers=headers
    )
    assert assert_error(reply, status)["param"] == param
    assert api.session(session["session_id"])["turns"] == []


def test_malformed_json_is_a_400_that_says_so(api: Api):
    session = api.new_session(task_id="malformed-json")
    headers = {"Content-Type": "application/json"}
    content = b'{"model": "tiny", "messages": ['
    reply = api.call(
        "POST", "/v1/chat/completions", key=session["api_key"], content=content, headers=headers
    )
    assert "JSON" in assert_error(reply, 400)["message"]


def test_a_refused_streamed_request_is_a_plain_400_not_an_event_stream(api: Api):
    session = api.new_session(task_id="bad-stream")
    body = {"model": MODEL, "messages": [user("hi")], "top_p": 0.5, "stream": True}
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=body)
    assert reply.headers["content-type"].startswith("application/json")
    assert assert_error(reply, 400)["param"] == "top_p"


def test_a_text_completion_without_a_prompt_is_a_400(api: Api):
    session = api.new_session(task_id="no-prompt")
    body = {"model": MODEL, "max_tokens": 2}
    reply = api.call("POST", "/v1/completions", key=session["api_key"], json=body)
    assert assert_error(reply, 400)["param"] == "prompt"


def test_an_ended_session_takes_no_more_turns(api: Api):
    session = api.new_session(task_id="ended")
    api.chat(session)
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    body = {"model": MODEL, "messages": [user("again")], "max_tokens": 2}
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=body)
    assert_error(reply, 409, code="session_closed")
    assert len(api.session(session["session_id"])["turns"]) == 1
