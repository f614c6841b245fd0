"""Hostile JSON into every field of the routes that store things, and what every reader makes of
it (hypothesis).

The values: strings of lone surrogates (sent as JSON escapes, as ``json.dumps`` writes them),
NUL, U+2028/U+2029/U+0085, U+FEFF, combining marks, astral characters, a special token's text,
long strings; NaN and infinities; nesting from 1 to 900 levels. The routes: session creation
(task_id, group_id, metadata keys and values), rewards, run creation and config, trainer steps,
and the chat, Anthropic messages, Responses and completions bodies.

Every answer is a success or a 4xx in the route's shape, never a 5xx (the TestClient raises the
server's exception). After each success every reader reads it back: the session view, the
dashboard's session page, the run's export, a claim of the session (which must carry it, or
drop it with a reason), the run view and the dashboard's run page."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.api_support import ADMIN_KEY, Api

ODD = [
    "\x00",
    "\u2028",
    "\u2029",
    "\u0085",
    "\ufeff",
    "e\u0301",
    "\u0301",
    "\U0001f600",
    "\U0010ffff",
    "<|im_end|>",
    '"',
    "\\",
]
pieces = st.one_of(
    st.characters(codec=None, categories=["Cs"]),  # lone surrogates
    st.sampled_from(ODD),
    st.characters(),
)
texts = st.one_of(
    st.lists(pieces, max_size=8).map("".join),
    st.integers(1_000, 120_000).map(lambda n: "y" * n),
)
scalars = st.one_of(texts, st.integers(-(2**70), 2**70), st.floats(), st.booleans(), st.none())
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


def nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


hostile = st.one_of(
    values, st.tuples(values, st.sampled_from([60, 63, 64, 65, 300, 900])).map(lambda t: nested(*t))
)


def send(api: Api, method: str, path: str, body: Any, key: str | None, **headers) -> Any:
    """``body`` as ``json.dumps`` writes it: surrogates escaped, NaN as a bare word."""
    headers = {"Content-Type": "application/json", **headers}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return api.http.request(method, path, content=json.dumps(body).encode(), headers=headers)


def assert_shaped(reply: Any, anthropic: bool = False) -> None:
    """A success, or a 4xx in the route's error shape."""
    assert reply.status_code < 500, reply.text
    if reply.status_code < 400:
        return
    body = reply.json()
    if anthropic:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def read_back(api: Api, run_id: str, session_id: str | None) -> None:
    """Every reader, on what was just stored."""
    assert api.ok("GET", f"/rl/runs/{run_id}")["id"] == run_id
    assert api.call("GET", f"/admin/runs/{run_id}").status_code == 200
    exported = api.call("GET", f"/rl/runs/{run_id}/export", params={"status": "all"})
    assert exported.status_code == 200
    for line in exported.text.splitlines():
        json.loads(line)
    if session_id is None:
        return
    view = api.session(session_id)
    assert api.call("GET", f"/admin/sessions/{session_id}").status_code == 200
    if view["status"] == "open":
        api.ok("POST", f"/rl/sessions/{session_id}/reward", json={"reward": 0.5})
        api.ok("POST", f"/rl/sessions/{session_id}/end")
    claim = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 1000})
    api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm", json={})
    after = api.session(session_id)
    claimed = {s["session_id"]: s for s in claim["sessions"]}
    if session_id in claimed:
        assert claimed[session_id]["metadata"] == after["metadata"]
    else:
        assert after["status"] == "dropped" and after["drop_reason"], after


@dataclass
class Sent:
    """One hostile request: the answer, its surface's shape, what it may have stored."""

    reply: Any
    run_id: str
    session_id: str | None  # the session to read back (None: a run's values only)
    anthropic: bool = False


@dataclass
class Case:
    api: Api
    run_id: str
    run_key: str
    session: dict
    value: Any
    text: str
    other: str

    def sent(self, reply: Any, **fields: Any) -> Sent:
        return Sent(reply, self.run_id, self.session["session_id"], **fields)


def create_session(case: Case) -> Sent:
    body = {
        "run_id": case.run_id,
        "task_id": case.text,
        "group_id": case.other,
        "metadata": {case.text: case.value},
    }
    reply = send(case.api, "POST", "/rl/sessions", body, case.run_key)
    if reply.status_code != 201:
        return case.sent(reply)
    case.api.chat(reply.json())
    return Sent(reply, case.run_id, reply.json()["session_id"])


def reward(case: Case) -> Sent:
    case.api.chat(case.session)
    body = {"reward": case.value, "completion_id": case.text}
    path = f"/rl/sessions/{case.session['session_id']}/reward"
    return case.sent(send(case.api, "POST", path, body, ADMIN_KEY))


def create_run(case: Case) -> Sent:
    body = {"name": case.text, "config": {"note": case.value}}
    reply = send(case.api, "POST", "/rl/runs", body, ADMIN_KEY)
    return Sent(reply, reply.json()["id"] if reply.status_code == 201 else case.run_id, None)


def patch_run(case: Case) -> Sent:
    body = {"config": {case.text: case.value}}
    return case.sent(send(case.api, "PATCH", f"/rl/runs/{case.run_id}", body, ADMIN_KEY))


def report_step(case: Case) -> Sent:
    body = {"step": 1, "version": 0, "metrics": {case.text: case.value, "note": case.other}}
    return case.sent(send(case.api, "POST", f"/rl/runs/{case.run_id}/steps", body, ADMIN_KEY))


def chat(case: Case) -> Sent:
    body = {
        "model": case.other,
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": case.other},
            {"role": "user", "content": case.text},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": case.value}}],
    }
    key = case.session["api_key"]
    return case.sent(send(case.api, "POST", "/v1/chat/completions", body, key))


def messages(case: Case) -> Sent:
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "system": case.other,
        "messages": [{"role": "user", "content": case.text}],
        "metadata": {"user_id": case.value},
    }
    headers = {"x-api-key": case.session["api_key"]}
    return case.sent(send(case.api, "POST", "/v1/messages", body, None, **headers), anthropic=True)


def responses(case: Case) -> Sent:
    body = {
        "model": "tiny",
        "max_output_tokens": 16,
        "input": case.text,
        "instructions": case.other,
    }
    return case.sent(send(case.api, "POST", "/v1/responses", body, case.session["api_key"]))


def completions(case: Case) -> Sent:
    body = {"model": "tiny", "max_tokens": 2, "prompt": case.text, "user": case.value}
    return case.sent(send(case.api, "POST", "/v1/completions", body, case.session["api_key"]))


ROUTES = {
    "session": create_session,
    "reward": reward,
    "run": create_run,
    "patch": patch_run,
    "steps": report_step,
    "chat": chat,
    "messages": messages,
    "responses": responses,
    "completions": completions,
}


@settings(
    max_examples=45,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=st.sampled_from(sorted(ROUTES)), value=hostile, text=texts, other=texts)
def test_hostile_json_gets_a_shaped_answer_and_every_reader_reads_what_was_kept(
    api: Api, route: str, value: Any, text: str, other: str
):
    run = api.new_run()
    session = api.new_session(run["id"], key=run["api_key"])
    case = Case(api, run["id"], run["api_key"], session, value, text, other)
    sent = ROUTES[route](case)
    assert_shaped(sent.reply, sent.anthropic)
    read_back(api, sent.run_id, sent.session_id)
