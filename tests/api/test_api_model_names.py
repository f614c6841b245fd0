"""Model names in-process: a run serves its model under any name a request asks for (the turn
records the name), lists its aliases on /v1/models, and with strict_model_names refuses other
names with OpenAI's 404 model_not_found, storing nothing."""

from __future__ import annotations

import pytest

from tests.api.api_support import Api, assert_error, sse_events

SERVED = "tiny"


def ask(model: str, stream: bool = False) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": model, "messages": messages, "max_tokens": 3, "stream": stream}


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet-4-5", "x" * 200])
def test_any_model_name_is_served_and_recorded(api: Api, model: str):
    session = api.new_session(task_id="any-name")
    answer = api.ok("POST", "/v1/chat/completions", key=session["api_key"], json=ask(model))
    # Like OpenAI, which answers an alias with the snapshot that served it: the served model.
    assert answer["model"] == SERVED
    (turn,) = api.session(session["session_id"])["turns"]
    assert (turn["completion_id"], turn["model"]) == (answer["id"], model)


LONG = "x" * 201  # longer than a turn records (turns.model): refused before anything is sampled
TOO_LONG = [
    ("/v1/chat/completions", ask(LONG)),
    ("/v1/completions", {"model": LONG, "prompt": "Once", "max_tokens": 2}),
    ("/v1/responses", {"model": LONG, "input": "hi", "max_output_tokens": 2}),
    (
        "/v1/messages",
        {"model": LONG, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    ),
]


@pytest.mark.parametrize(("path", "body"), TOO_LONG, ids=[path for path, _ in TOO_LONG])
def test_a_model_name_longer_than_a_turn_records_is_a_400_and_stores_nothing(api, path, body):
    # On Postgres such a name failed the whole write batch, other sessions' turns with it.
    session = api.new_session(task_id="long-name")
    reply = api.call("POST", path, key=session["api_key"], json=body)
    assert reply.status_code == 400
    if path == "/v1/messages":
        assert reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "invalid_request_error"
    else:
        assert_error(reply, 400)
    assert api.session(session["session_id"])["turns"] == []


def test_a_text_completion_under_another_name_is_recorded_with_it(api: Api):
    session = api.new_session(task_id="any-name-text")
    body = {"model": "gpt-3.5-turbo-instruct", "prompt": "Once", "max_tokens": 2}
    answer = api.ok("POST", "/v1/completions", key=session["api_key"], json=body)
    (turn,) = api.session(session["session_id"])["turns"]
    assert (turn["surface"], turn["model"], answer["model"]) == (
        "completions",
        "gpt-3.5-turbo-instruct",
        SERVED,
    )


def test_models_lists_the_served_model_then_the_runs_aliases(api: Api):
    run = api.new_run(model_aliases=["gpt-4o-mini", SERVED, "claude-sonnet-4-5"])
    session = api.new_session(run["id"])
    for key, path in [
        (run["api_key"], "/v1/models"),
        (session["api_key"], "/v1/models"),
        (session["api_key"], f"/sessions/{session['session_id']}/v1/models"),
    ]:
        listing = api.ok("GET", path, key=key)
        assert [card["id"] for card in listing["data"]] == [
            SERVED,
            "gpt-4o-mini",
            "claude-sonnet-4-5",
        ]
        assert {card["owned_by"] for card in listing["data"]} == {"proxrl"}
    # The admin key lists the default run's names: the served model alone.
    assert [card["id"] for card in api.ok("GET", "/v1/models")["data"]] == [SERVED]


def test_strict_names_refuse_others_in_openai_shape_and_store_nothing(api: Api):
    run = api.new_run(model_aliases=["gpt-4o-mini"], strict_model_names=True)
    session = api.new_session(run["id"])
    key = session["api_key"]
    for stream in (False, True):
        reply = api.call("POST", "/v1/chat/completions", key=key, json=ask("gpt-4o", stream))
        error = assert_error(reply, 404, code="model_not_found")
        assert error["param"] == "model" and error["type"] == "not_found_error"
        assert "'gpt-4o'" in error["message"] and "'gpt-4o-mini'" in error["message"]
    text = {"model": "davinci", "prompt": "Once", "max_tokens": 2}
    assert_error(api.call("POST", "/v1/completions", key=key, json=text), 404)
    assert api.session(session["session_id"])["turns"] == []

    api.ok("POST", "/v1/chat/completions", key=key, json=ask(SERVED))
    events = sse_events(
        api.call("POST", "/v1/chat/completions", key=key, json=ask("gpt-4o-mini", True))
    )
    assert events[-1] == "[DONE]"
    models = [turn["model"] for turn in api.session(session["session_id"])["turns"]]
    assert models == [SERVED, "gpt-4o-mini"]


def test_strictness_follows_a_patch_of_the_run(api: Api):
    run = api.new_run()
    session = api.new_session(run["id"])
    api.ok("POST", "/v1/chat/completions", key=session["api_key"], json=ask("gpt-4o"))
    api.ok("PATCH", f"/rl/runs/{run['id']}", json={"config": {"strict_model_names": True}})
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=ask("gpt-4o"))
    assert_error(reply, 404, code="model_not_found")


@pytest.mark.parametrize(
    "config",
    [{"model_aliases": "gpt-4o"}, {"model_aliases": [""]}, {"strict_model_names": "yes"}],
)
def test_bad_model_name_settings_are_a_422_naming_the_field(api: Api, config: dict):
    reply = api.call("POST", "/rl/runs", json={"name": "bad-names", "config": config})
    assert assert_error(reply, 422)["param"].startswith(f"config.{next(iter(config))}")


def test_every_surface_serves_any_name_and_refuses_others_in_its_shape_when_strict(api: Api):
    loose = api.new_session(task_id="any-name-surfaces")
    strict_run = api.new_run(model_aliases=["claude-sonnet-4-5"], strict_model_names=True)
    strict = api.new_session(strict_run["id"])
    anthropic = {"anthropic-version": "2023-06-01"}
    responses = {"input": "hi", "max_output_tokens": 3}
    messages = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def responses_call(session: dict, model: str):
        body = {"model": model, **responses}
        return api.call("POST", "/v1/responses", key=session["api_key"], json=body)

    def messages_call(session: dict, model: str):
        return api.call(
            "POST",
            "/v1/messages",
            key=None,
            json={"model": model, **messages},
            headers={"x-api-key": session["api_key"], **anthropic},
        )

    assert responses_call(loose, "gpt-4.1").status_code == 200
    assert messages_call(loose, "claude-opus-4-1").status_code == 200
    turns = api.session(loose["session_id"])["turns"]
    assert [(t["surface"], t["model"]) for t in turns] == [
        ("responses", "gpt-4.1"),
        ("messages", "claude-opus-4-1"),
    ]

    error = assert_error(responses_call(strict, "gpt-4.1"), 404, code="model_not_found")
    assert error["param"] == "model"
    refused = messages_call(strict, "claude-opus-4-1")
    assert refused.status_code == 404, refused.text
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "not_found_error"
    assert api.session(strict["session_id"])["turns"] == []
    assert messages_call(strict, "claude-sonnet-4-5").status_code == 200
