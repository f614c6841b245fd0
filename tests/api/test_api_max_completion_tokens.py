"""A run's ``max_completion_tokens`` caps every answer on every surface, whatever the request
asks: more than the cap, or no limit at all (the Codex CLI sends none), is cut at the cap; less
is kept. Set as users set it (``PATCH /rl/runs/{id}``), checked through what each surface answers
and what the store records (``sampling.max_tokens``, the completion's length)."""

from __future__ import annotations

import pytest

from tests.api.api_support import Api

CAP = 3
CONTEXT = 2048  # the api tier's tiny model

# One request per surface: its path and body, the limit given by ``limit`` (None: none given).
SURFACES = {
    "chat": ("/v1/chat/completions", "max_tokens"),
    "completions": ("/v1/completions", "max_tokens"),
    "responses": ("/v1/responses", "max_output_tokens"),
    "messages": ("/v1/messages", "max_tokens"),
}


def body(surface: str, limit: int | None) -> dict:
    _, field = SURFACES[surface]
    if surface == "completions":
        request: dict = {"model": "tiny", "prompt": "Count: one two"}
    elif surface == "responses":
        request = {"model": "tiny", "input": "Count to ten."}
    else:
        request = {"model": "tiny", "messages": [{"role": "user", "content": "Count to ten."}]}
    if limit is not None:
        request[field] = limit
    elif surface == "messages":  # Anthropic's max_tokens is required: the largest the room allows
        request[field] = CONTEXT - 64
    return request


@pytest.mark.parametrize("surface", sorted(SURFACES))
@pytest.mark.parametrize("asked", [None, 1, CAP, 50])
def test_every_answer_is_cut_at_the_runs_cap(api: Api, surface: str, asked: int | None):
    session = api.session_of_run({"max_completion_tokens": CAP}, task_id="cap")
    path, _ = SURFACES[surface]
    reply = api.call("POST", path, key=session["api_key"], json=body(surface, asked))
    assert reply.status_code == 200, reply.text
    (turn,) = api.session(session["session_id"])["turns"]
    expected = CAP if asked is None or asked > CAP else asked
    assert turn["sampling"]["max_tokens"] == expected
    assert 1 <= len(turn["completion_ids"]) <= expected


def test_without_a_cap_a_request_without_a_limit_may_fill_the_context(api: Api):
    session = api.session_of_run({"max_completion_tokens": None}, task_id="cap")
    reply = api.call("POST", "/v1/responses", key=session["api_key"], json=body("responses", None))
    assert reply.status_code == 200, reply.text
    (turn,) = api.session(session["session_id"])["turns"]
    assert turn["sampling"]["max_tokens"] == CONTEXT - len(turn["prompt_ids"])


def test_a_limit_past_the_context_is_served_when_the_cap_fits(api: Api):
    """Claude Code asks 32,000 tokens whatever the context: under a cap the request is served."""
    session = api.session_of_run({"max_completion_tokens": CAP}, task_id="cap")
    reply = api.call("POST", "/v1/messages", key=session["api_key"], json=body("messages", 32000))
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["usage"]["output_tokens"] <= CAP
    # Cut by the run's cap, not by the context: Claude Code reads model_context_window_exceeded
    # as "the model has reached its context window limit".
    cut = answer["usage"]["output_tokens"] == CAP
    assert answer["stop_reason"] == ("max_tokens" if cut else "end_turn"), answer


@pytest.mark.parametrize("cap", [0, -1, 1.5, "8"])
def test_a_cap_that_is_no_positive_integer_is_refused(api: Api, cap: object):
    run = api.new_run()
    reply = api.call(
        "PATCH", f"/rl/runs/{run['id']}", json={"config": {"max_completion_tokens": cap}}
    )
    assert reply.status_code == 422, reply.text
    assert "max_completion_tokens" in reply.text
    assert api.ok("GET", f"/rl/runs/{run['id']}")["config"].get("max_completion_tokens") is None
