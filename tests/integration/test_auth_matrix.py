"""Every route against every kind of caller, on one real ``proxrl serve``.

``ACCESS`` below is the one statement of who may call what. The routes are read from the app
itself (its OpenAPI document and the dashboard pages outside it): a route missing from the
table fails the test, so a new route must declare its access here. Each route is called once
by each caller with real ids (a run, two of its sessions, another run, a claim); the answer must
be allowed (any status but 401/403, and no 5xx), or refused as the rule says: 401 for no key, a
wrong key or an empty one, 403 for a valid key without the right, both in our error shape
(``{"error": {"message", "type", "param", "code"}}``), or for a dashboard page without a key,
a redirect to the login form.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from fastapi.routing import iter_route_contexts

from server.main import create_app
from server.proxy.anthropic_schemas import anthropic_type, is_anthropic_path
from server.settings import ServerSettings
from tests.support import ProxyProcess

pytestmark = pytest.mark.timeout(240)

ALLOWED, NO_KEY, NO_RIGHT, LOGIN = "allowed", 401, 403, "login"
CALLERS = ("none", "wrong", "empty", "session", "other_session", "run", "other_run", "admin")

# Who may call a route, caller by caller (the columns are CALLERS, in order).
# none: no Authorization header; wrong: a key proxrl never issued; empty: "Bearer" alone;
# session: the key of session A; other_session: the key of session B (same run); run: the key
# of A's run; other_run: the key of another run; admin: the admin key. Every caller also sends
# X-Session-Id: A (how a run key names its session on the OpenAI routes).
_ = ALLOWED
RULES: dict[str, tuple] = {
    #              none     wrong    empty    session   other_s   run       other_r   admin
    "open":       (_,       _,       _,       _,        _,        _,        _,        _),
    "any_key":    (NO_KEY,  NO_KEY,  NO_KEY,  _,        _,        _,        _,        _),
    # The OpenAI routes generate in the key's own session (a run key or the admin: X-Session-Id).
    "agent":      (NO_KEY,  NO_KEY,  NO_KEY,  _,        _,        _,        NO_RIGHT, _),
    # /sessions/{id}/v1/...: the unguessable id is the credential; an unknown key counts as none.
    "path":       (_,       _,       _,       _,        NO_RIGHT, _,        NO_RIGHT, _),
    "session":    (NO_KEY,  NO_KEY,  NO_KEY,  _,        NO_RIGHT, _,        NO_RIGHT, _),
    "run":        (NO_KEY,  NO_KEY,  NO_KEY,  NO_RIGHT, NO_RIGHT, _,        NO_RIGHT, _),
    "admin":      (NO_KEY,  NO_KEY,  NO_KEY,  NO_RIGHT, NO_RIGHT, NO_RIGHT, NO_RIGHT, _),
    "page":       (LOGIN,   NO_KEY,  NO_KEY,  NO_RIGHT, NO_RIGHT, NO_RIGHT, NO_RIGHT, _),
}  # fmt: skip

ACCESS: dict[tuple[str, str], str] = {
    ("GET", "/health"): "open",
    ("GET", "/"): "open",
    ("GET", "/metrics"): "open",  # on loopback; elsewhere the admin key (tested in test_proxy_rest)
    ("GET", "/openapi.json"): "open",
    ("GET", "/docs"): "open",
    ("GET", "/docs/oauth2-redirect"): "open",
    ("GET", "/redoc"): "open",
    # OpenAI surface
    ("GET", "/v1/models"): "any_key",
    ("POST", "/v1/chat/completions"): "agent",
    ("POST", "/v1/completions"): "agent",
    ("GET", "/sessions/{session_id}/v1/models"): "path",
    ("POST", "/sessions/{session_id}/v1/chat/completions"): "path",
    ("POST", "/sessions/{session_id}/v1/completions"): "path",
    # Anthropic Messages (errors in Anthropic's shape)
    ("POST", "/v1/messages"): "agent",
    ("POST", "/v1/messages/count_tokens"): "agent",
    ("POST", "/sessions/{session_id}/v1/messages"): "path",
    ("POST", "/sessions/{session_id}/v1/messages/count_tokens"): "path",
    ("POST", "/v1/responses"): "agent",
    ("GET", "/v1/responses/{response_id}"): "agent",
    ("DELETE", "/v1/responses/{response_id}"): "agent",
    ("POST", "/sessions/{session_id}/v1/responses"): "path",
    ("GET", "/sessions/{session_id}/v1/responses/{response_id}"): "path",
    ("DELETE", "/sessions/{session_id}/v1/responses/{response_id}"): "path",
    # sessions
    ("POST", "/rl/sessions"): "run",
    ("GET", "/rl/sessions"): "admin",
    ("GET", "/rl/sessions/{session_id}"): "session",
    ("POST", "/rl/sessions/{session_id}/reward"): "session",
    ("POST", "/rl/sessions/{session_id}/end"): "session",
    # runs and the trainer's calls
    ("POST", "/rl/runs"): "admin",
    ("GET", "/rl/runs"): "admin",
    ("GET", "/rl/runs/{run_id}"): "run",
    ("PATCH", "/rl/runs/{run_id}"): "admin",
    ("GET", "/rl/runs/{run_id}/export"): "admin",
    ("POST", "/rl/runs/{run_id}/claims"): "admin",
    ("POST", "/rl/runs/{run_id}/steps"): "admin",
    ("POST", "/rl/runs/{run_id}/promote"): "admin",
    ("GET", "/rl/runs/{run_id}/versions"): "run",
    ("POST", "/rl/runs/{run_id}/rollback"): "admin",
    ("POST", "/rl/claims/renew"): "admin",
    ("POST", "/rl/claims/{claim_id}/confirm"): "admin",
    ("POST", "/rl/claims/{claim_id}/drop"): "admin",
    ("POST", "/rl/claims/{claim_id}/trained"): "admin",
    ("POST", "/rl/claims/{claim_id}/release"): "admin",
    # administration
    ("POST", "/admin/weights"): "admin",
    ("POST", "/admin/weights/group"): "admin",
    ("POST", "/admin/weights/probe"): "admin",
    ("GET", "/admin/engines"): "admin",
    ("GET", "/admin/leader"): "admin",
    # dashboard JSON
    ("GET", "/admin/api/runs"): "admin",
    ("GET", "/admin/api/runs/{run_id}"): "admin",
    ("GET", "/admin/api/runs/{run_id}/series"): "admin",
    ("GET", "/admin/api/sessions"): "admin",
    ("GET", "/admin/api/sessions/{session_id}"): "admin",
    ("GET", "/admin/api/engines"): "admin",
    # dashboard pages (not in the OpenAPI document)
    ("GET", "/admin"): "open",  # a redirect to /admin/runs
    ("GET", "/admin/login"): "open",
    ("POST", "/admin/login"): "open",  # the form carries the key, not the header
    ("POST", "/admin/logout"): "open",
    ("GET", "/admin/runs"): "page",
    ("GET", "/admin/runs/{run_id}"): "page",
    ("GET", "/admin/sessions"): "page",
    ("GET", "/admin/sessions/{session_id}"): "page",
    ("GET", "/admin/pool"): "page",
    ("GET", "/admin/static/{name}"): "page",
}

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
MESSAGE = {"model": "claude", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
# What each route is sent: enough that an allowed call is a real one. The admin-only calls that
# would change the engines get bodies they refuse (422): allowed is any answer but 401/403.
BODIES: dict[tuple[str, str], dict] = {
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/v1/completions"): COMPLETION,
    ("POST", "/sessions/{session_id}/v1/chat/completions"): CHAT,
    ("POST", "/sessions/{session_id}/v1/completions"): COMPLETION,
    ("POST", "/v1/messages"): MESSAGE,
    ("POST", "/v1/messages/count_tokens"): MESSAGE,
    ("POST", "/sessions/{session_id}/v1/messages"): MESSAGE,
    ("POST", "/sessions/{session_id}/v1/messages/count_tokens"): MESSAGE,
    ("POST", "/v1/responses"): RESPONSE,
    ("POST", "/sessions/{session_id}/v1/responses"): RESPONSE,
    ("POST", "/rl/sessions"): {"run_id": "{run_id}"},
    ("POST", "/rl/sessions/{session_id}/reward"): {"reward": 1.0},
    ("POST", "/rl/runs"): {"name": "matrix"},
    ("PATCH", "/rl/runs/{run_id}"): {"config": {}},
    ("POST", "/rl/runs/{run_id}/claims"): {"max_sessions": 1},
    ("POST", "/rl/runs/{run_id}/steps"): {"step": 1, "version": 0},
    ("POST", "/rl/runs/{run_id}/promote"): {"version": 0},
    ("POST", "/rl/runs/{run_id}/rollback"): {"version": 0},
    ("POST", "/rl/claims/renew"): {"claim_ids": ["{claim_id}"]},
    ("POST", "/rl/claims/{claim_id}/drop"): {"dropped": {}},
    ("POST", "/rl/claims/{claim_id}/trained"): {"version": 0},
    ("POST", "/admin/weights"): {},
    ("POST", "/admin/weights/group"): {},
    ("POST", "/admin/weights/probe"): {},
}
FORMS = {("POST", "/admin/login"): {"key": ProxyProcess.ADMIN_KEY, "next": "/admin/runs"}}
# Calls that end something: made after every other route, so that those still see it open.
LAST = [("POST", "/rl/claims/{claim_id}/release"), ("POST", "/rl/sessions/{session_id}/end")]


def app_routes(model_dir) -> set[tuple[str, str]]:
    """Every (method, path) the app serves (HEAD, which GET implies, left out)."""
    app = create_app(ServerSettings(model=str(model_dir)))
    return {
        (method, context.path)
        for context in iter_route_contexts(app.routes)
        for method in getattr(context.original_route, "methods", None) or ()
        if method != "HEAD" and context.path is not None
    }


@dataclass
class World:
    """The ids the path parameters resolve to, and each caller's headers."""

    ids: dict[str, str]
    keys: dict[str, str | None]

    def headers(self, caller: str) -> dict[str, str]:
        headers = {"X-Session-Id": self.ids["session_id"]}
        if caller == "empty":
            # "Bearer " as the server reads it: HTTP strips the trailing space (and h11 will not
            # even send one)
            headers["Authorization"] = "Bearer"
        elif self.keys[caller] is not None:
            headers["Authorization"] = f"Bearer {self.keys[caller]}"
        return headers

    def fill(self, value):
        """``value`` with every {name} of a path parameter replaced by its real id."""
        if isinstance(value, str):
            return value.format(**self.ids) if "{" in value else value
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        return value


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("matrix")) as process:
        yield process


def make_world(http: httpx.Client) -> World:
    def ok(method: str, path: str, body: dict) -> dict:
        reply = http.request(method, path, json=body)
        assert reply.status_code in (200, 201), reply.text
        return reply.json()

    run = ok("POST", "/rl/runs", {"name": "matrix-run"})
    other_run = ok("POST", "/rl/runs", {"name": "matrix-other"})
    session = ok("POST", "/rl/sessions", {"run_id": run["id"]})
    other_session = ok("POST", "/rl/sessions", {"run_id": run["id"]})
    claim = ok("POST", f"/rl/runs/{run['id']}/claims", {"max_sessions": 1})
    ids = {
        "run_id": run["id"],
        "session_id": session["session_id"],
        "claim_id": claim["claim_id"],
        "name": "dashboard.js",
        "response_id": "resp_matrix",  # none such: an allowed caller gets a 404
    }
    keys = {
        "none": None,
        "wrong": "sk-not-a-key-proxrl-issued",
        "empty": None,
        "session": session["api_key"],
        "other_session": other_session["api_key"],
        "run": run["api_key"],
        "other_run": other_run["api_key"],
        "admin": ProxyProcess.ADMIN_KEY,
    }
    return World(ids, keys)


def judge(expected, reply: httpx.Response) -> str | None:
    """What is wrong with ``reply`` given the rule's ``expected`` outcome (None: nothing)."""
    status = reply.status_code
    if expected == ALLOWED:
        if status in (401, 403) or status >= 500:
            return f"allowed, got {status}: {reply.text[:200]}"
        return None
    if expected == LOGIN:
        location = reply.headers.get("location", "")
        if status != 303 or not location.startswith("/admin/login?next="):
            return f"a redirect to the login form, got {status} {location!r}"
        return None
    if status != expected:
        return f"{expected}, got {status}: {reply.text[:200]}"
    if is_anthropic_path(reply.request.url.path):
        return _judge_anthropic(status, reply)
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without our error body: {reply.text[:200]}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"{status} with an error body of another shape: {error}"
    return None


def _judge_anthropic(status: int, reply: httpx.Response) -> str | None:
    """Anthropic's routes refuse in Anthropic's shape: {"type": "error", "error": {...}}."""
    try:
        body = reply.json()
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without Anthropic's error body: {reply.text[:200]}"
    kind = anthropic_type(status)
    if body.get("type") != "error" or set(error) != {"type", "message"} or error["type"] != kind:
        return f"{status} with an error body of another shape: {body}"
    return None


def test_every_route_answers_every_caller_as_its_access_rule_says(proxy, tiny_model_dir):
    routes = app_routes(tiny_model_dir)
    documented = {
        (method.upper(), path)
        for path, operations in httpx.get(f"{proxy.url}/openapi.json").json()["paths"].items()
        for method in operations
    }
    assert documented <= routes
    assert sorted(routes - ACCESS.keys()) == [], "routes without an access rule in ACCESS"
    assert sorted(ACCESS.keys() - routes) == [], "ACCESS names routes the app does not serve"

    with httpx.Client(base_url=proxy.url, headers=proxy.admin, timeout=60) as admin:
        world = make_world(admin)
    order = sorted(routes - set(LAST)) + LAST
    problems, seen = [], {}
    with httpx.Client(base_url=proxy.url, timeout=60, follow_redirects=False) as http:
        for method, path in order:
            rule = RULES[ACCESS[method, path]]
            for caller, expected in zip(CALLERS, rule, strict=True):
                body = BODIES.get((method, path))
                reply = http.request(
                    method,
                    world.fill(path),
                    headers=world.headers(caller),
                    json=world.fill(body) if body is not None else None,
                    data=FORMS.get((method, path)),
                )
                seen.setdefault(f"{method} {path}", []).append(reply.status_code)
                wrong = judge(expected, reply)
                if wrong is not None:
                    problems.append(f"{method} {path} as {caller}: expected {wrong}")
    print(f"\n{len(routes)} routes x {len(CALLERS)} callers; statuses per caller {CALLERS}:")
    print("\n".join(f"{route:55} {statuses}" for route, statuses in seen.items()))
    assert problems == [], "\n".join(problems)
