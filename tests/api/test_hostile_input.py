"""Input no reader could serve back is refused at the door, in the surface's error shape.

Each attack of issue 26 as it was sent: a lone surrogate (the JSON escape ``"\\ud800"``) in session
metadata, a run's config, a chat message, an Anthropic message, a Responses input; metadata
nested 900 deep or larger than max_metadata_bytes, or holding NaN; a NUL character in a value
bound for a text column (on PostgreSQL, where it was a 500) or in a path. Before: 201/200 (and
every reader of the row failed later), or a 500."""

from __future__ import annotations

import json

import pytest

from tests.api import store_backends
from tests.api.api_support import ADMIN_KEY, Api, assert_error

backend_api, store_url = store_backends.backend_api, store_backends.store_url  # the fixtures

LONE = '"\\ud800"'  # as JSON text: the escape of a lone surrogate
PAIRED = '"\\ud83d\\ude00"'  # an emoji, escaped as a pair: fine


def send(api: Api, method: str, path: str, body: str, key: str | None = ADMIN_KEY, **headers):
    """``body`` as the JSON text it is (the SDKs could not send a lone surrogate)."""
    headers = {"Content-Type": "application/json", **headers}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return api.http.request(method, path, content=body.encode(), headers=headers)


def assert_anthropic_error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_a_lone_surrogate_is_refused_on_every_rest_body_that_stores_it(api: Api):
    run = api.new_run()
    bodies = [
        ("POST", "/rl/sessions", f'{{"run_id": "{run["id"]}", "metadata": {{"a": {LONE}}}}}'),
        ("POST", "/rl/sessions", f'{{"run_id": "{run["id"]}", "metadata": {{{LONE}: 1}}}}'),
        ("PATCH", f"/rl/runs/{run['id']}", f'{{"config": {{"trainer_note": {LONE}}}}}'),
        ("POST", "/rl/runs", f'{{"name": "r", "config": {{"note": [1, {LONE}]}}}}'),
    ]
    for method, path, body in bodies:
        error = assert_error(send(api, method, path, body), 400, code="unservable_json")
        assert "lone surrogate" in error["message"], error
    # An escaped pair is a character like any other.
    body = f'{{"run_id": "{run["id"]}", "metadata": {{"emoji": {PAIRED}}}}}'
    created = send(api, "POST", "/rl/sessions", body, key=run["api_key"])
    assert created.status_code == 201, created.text
    assert api.session(created.json()["session_id"])["metadata"] == {"emoji": "\U0001f600"}


def test_a_lone_surrogate_is_refused_on_every_model_route_in_its_shape(api: Api):
    session = api.new_session()
    key = session["api_key"]
    chat = (
        f'{{"model": "tiny", "max_tokens": 2, "messages": [{{"role": "user", "content": {LONE}}}]}}'
    )
    assert_error(
        send(api, "POST", "/v1/chat/completions", chat, key=key), 400, code="unservable_json"
    )
    completion = f'{{"model": "tiny", "max_tokens": 2, "prompt": {LONE}}}'
    assert_error(send(api, "POST", "/v1/completions", completion, key=key), 400)
    responses = f'{{"model": "tiny", "max_output_tokens": 16, "input": {LONE}}}'
    assert_error(send(api, "POST", "/v1/responses", responses, key=key), 400)
    messages = (
        f'{{"model": "tiny", "max_tokens": 2, "messages": [{{"role": "user", "content": {LONE}}}]}}'
    )
    error = assert_anthropic_error(
        send(api, "POST", "/v1/messages", messages, key=None, **{"x-api-key": key}), 400
    )
    assert error["type"] == "invalid_request_error" and "lone surrogate" in error["message"]
    path_form = f"/sessions/{session['session_id']}/v1/chat/completions"
    assert_error(send(api, "POST", path_form, chat, key=None), 400, code="unservable_json")
    assert api.session(session["session_id"])["turn_count"] == 0


def test_metadata_is_bounded_in_depth_size_and_numbers(api: Api):
    run = api.new_run()

    def create(metadata_json: str):
        body = f'{{"run_id": "{run["id"]}", "metadata": {{"m": {metadata_json}}}}}'
        return send(api, "POST", "/rl/sessions", body, key=run["api_key"])

    # max_json_depth (64) counts the body's levels: the body, metadata, then the value's.
    assert create("[" * 62 + "]" * 62).status_code == 201
    for depth in (63, 900, 5000):
        error = assert_error(create("[" * depth + "]" * depth), 400, code="unservable_json")
        assert "nesting deeper than 64" in error["message"]
    error = assert_error(create(json.dumps("x" * 70_000)), 400)
    assert error["param"] == "metadata" and "max_metadata_bytes" in error["message"]
    assert create(json.dumps("x" * 60_000)).status_code == 201
    for constant in ("NaN", "Infinity", "-Infinity"):  # the door refuses them on every route
        assert_error(create(constant), 400, code="unservable_json")


def test_a_nul_character_is_refused_where_a_text_column_would_hold_it(backend_api: Api):
    """On PostgreSQL a NUL in task_id, a model name, an id in the path was a 500; NUL inside
    free-form JSON (metadata, messages) is stored escaped and served back."""
    api = backend_api
    run = api.new_run()
    for field in ("task_id", "group_id"):
        body = f'{{"run_id": "{run["id"]}", "{field}": "a\\u0000b"}}'
        error = assert_error(send(api, "POST", "/rl/sessions", body), 422)
        assert error["param"] == field and "NUL" in error["message"]
    assert_error(send(api, "POST", "/rl/runs", '{"name": "a\\u0000"}'), 422)
    assert_error(api.call("GET", "/rl/sessions/a%00b"), 404)
    assert_error(api.call("GET", "/rl/sessions", params={"task_id": "a\x00b"}), 422)
    body = f'{{"run_id": "{run["id"]}", "metadata": {{"k": "a\\u0000b"}}}}'
    created = send(api, "POST", "/rl/sessions", body, key=run["api_key"])
    assert created.status_code == 201, created.text
    session = created.json()
    model = (
        '{"model": "t\\u0000", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
    )
    reply = send(api, "POST", "/v1/chat/completions", model, key=session["api_key"])
    assert assert_error(reply, 400)["param"] == "model"
    text = '{"model": "t", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\u0000b"}]}'
    reply = send(api, "POST", "/v1/chat/completions", text, key=session["api_key"])
    assert reply.status_code == 200, reply.text
    view = api.session(session["session_id"])
    assert view["metadata"] == {"k": "a\x00b"}
    assert view["turns"][0]["messages"][0]["content"] == "a\x00b"


@pytest.mark.parametrize("path", ["/rl/sessions", "/v1/chat/completions", "/v1/messages"])
def test_an_unknown_key_or_none_is_refused_before_the_body_is_looked_at(api: Api, path: str):
    """The body here is not even JSON: the 401 comes first, as it does for a 40 MB one."""
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"x-api-key": "not-a-key"}):
        reply = api.http.post(path, content=b"{not json", headers=headers)
        assert reply.status_code == 401, reply.text


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-2E+999"])
def test_a_number_json_cannot_hold_is_refused_on_every_route(api: Api, number: str):
    """NaN, Infinity and numbers past a double's range read as non-finite floats in Python:
    a tool's parameters holding one were stored, then every reader of the session failed (the
    view a 500, the export invalid JSON; on Postgres the write failed with its batch)."""
    session = api.new_session()
    tools = (
        f'[{{"type": "function", "function": {{"name": "f", "parameters": {{"x": {number}}}}}}}]'
    )
    chat = (
        f'{{"model": "tiny", "max_tokens": 2, "tools": {tools}, '
        '"messages": [{"role": "user", "content": "hi"}]}'
    )
    reply = send(api, "POST", "/v1/chat/completions", chat, key=session["api_key"])
    assert (
        "a number JSON cannot hold" in assert_error(reply, 400, code="unservable_json")["message"]
    )
    metadata = f'{{"metadata": {{"score": {number}}}}}'
    assert_error(send(api, "POST", "/rl/sessions", metadata), 400, code="unservable_json")
    quoted = f'{{"metadata": {{"note": "{number} as text is text"}}}}'
    assert send(api, "POST", "/rl/sessions", quoted).status_code == 201
    assert api.session(session["session_id"])["turns"] == []


def test_a_string_never_closed_is_read_in_linear_time_at_the_door(api: Api):
    """An unclosed string full of escaped quotes made the door's string scan restart at each
    quote: 80 KB took 19 s on the event loop, before any key was checked. 2 MB now takes a
    fraction of a second (the bound is far under what the quadratic scan needs for 200 KB)."""
    import time

    from server.limits import json_problem

    for size in (80_000, 2_000_000):
        body = b"[" * 65 + b'"' + b'\\"' * size
        started = time.perf_counter()
        assert json_problem(body, 64) is not None  # its brackets never close
        assert time.perf_counter() - started < 2.0, size
    reply = api.http.post(
        "/admin/runs", content=b"[" * 65 + b'"' + b'\\"' * 40_000, headers={"X": "y"}
    )
    assert reply.status_code < 500, reply.text


def test_a_surrogate_sent_as_its_own_bytes_is_refused_like_its_escape(api: Api):
    """JSON readers decode a body with surrogatepass, so the bytes ED A0 80 read as a lone
    U+D800 just as the escape does. The door looked for escapes only: such metadata was stored
    (201) and every reader of the session then failed on it."""
    run = api.new_run()
    raw = f'{{"run_id": "{run["id"]}", "metadata": {{"a": "\ud800"}}}}'
    reply = api.http.post(
        "/rl/sessions",
        content=raw.encode("utf-8", "surrogatepass"),
        headers={"Authorization": f"Bearer {run['api_key']}", "Content-Type": "application/json"},
    )
    error = assert_error(reply, 400, code="unservable_json")
    assert "lone surrogate" in error["message"], error
    session = api.new_session()
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}'
    reply = api.http.post(
        "/v1/chat/completions",
        content=chat.encode("utf-8", "surrogatepass"),
        headers={
            "Authorization": f"Bearer {session['api_key']}",
            "Content-Type": "application/json",
        },
    )
    assert_error(reply, 400, code="unservable_json")
    assert api.session(session["session_id"])["turns"] == []


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32-be"])
def test_json_in_utf16_or_utf32_is_refused_at_the_door(api: Api, encoding: str):
    """JSON readers take UTF-16 and UTF-32 bodies too (json.loads detects them), where the
    door's scans see no ``\\ud800`` escape: a lone surrogate in such metadata was stored (201)
    and broke every reader of the session. JSON on the wire is UTF-8 (RFC 8259)."""
    run = api.new_run()
    body = json.dumps({"run_id": run["id"], "metadata": {"a": "\ud800"}}).encode(encoding)
    reply = api.http.post(
        "/rl/sessions",
        content=body,
        headers={"Authorization": f"Bearer {run['api_key']}", "Content-Type": "application/json"},
    )
    error = assert_error(reply, 400, code="unservable_json")
    assert "UTF-8" in error["message"], error
    fine = json.dumps({"run_id": run["id"], "metadata": {"a": "b"}}).encode("utf-8-sig")
    reply = api.http.post(
        "/rl/sessions",
        content=fine,
        headers={"Authorization": f"Bearer {run['api_key']}", "Content-Type": "application/json"},
    )
    assert reply.status_code == 201, reply.text  # UTF-8 with a byte order mark is UTF-8


def test_a_distributed_publish_naming_many_tensors_is_not_held_to_the_container_bound(api: Api):
    """A large MoE's distributed publish lists one shape per tensor, past max_json_containers
    (50,000): /admin/weights is the admin's, and is not counted; the model routes are."""
    shapes = [[4, 4]] * 60_000
    body = {"distributed": {"names": [f"t{i}" for i in range(60_000)], "shapes": shapes}}
    reply = api.call("POST", "/admin/weights", json=body)
    assert reply.status_code != 413, reply.text[:300]
    session = api.new_session()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 60_000}
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=chat)
    assert_error(reply, 413)
