"""Every error the server answers with: one tree of domain exceptions, rendered in one place in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Another API's routes may answer in its own shape, same status (``ErrorShape``, see ``install``).

Domain modules raise these, named for what went wrong (never HTTPException, never a status);
``RENDERING`` says once, per class, which HTTP status, error type and default code the client
gets, and whether it says when to retry. The exception handlers (``install``), the OpenAPI
document (``documented``) and the error event a stream ends with
(``server.proxy.streaming.api_error``) all read that table. The tree::

    ProxrlError                  500  a bug: logged with its traceback, never shown
    ├── InvalidRequest           400  the request is malformed; the message says what to fix
    │   └── PromptTooLong        400  the prompt (plus max_tokens) exceeds the context
    ├── InvalidConfig            422  a run config that does not validate
    ├── NotInClaim               422  sessions named in ``dropped`` that are not the claim's
    ├── AuthenticationRequired   401  no key, or not one the call takes
    │   └── InvalidKey           401  a key proxrl did not issue
    ├── KeyOutOfScope            403  a valid key that cannot reach this run, session or call
    ├── BodyTooLarge             413  a body over the route's limit (max_body_bytes, ...)
    ├── ResourceNotFound         404  no such thing (a dashboard file)
    │   ├── RunNotFound          404
    │   ├── SessionNotFound      404
    │   ├── ClaimNotFound        404  no session ever carried that claim id
    │   ├── CompletionNotFound   404  no turn with that completion_id in the session
    │   ├── ResponseNotFound     404  no stored (Responses API) response with that id
    │   ├── ModelNotFound        404  a model name this server does not serve
    │   └── VersionNotFound      404  a version the run never published
    ├── VersionEvicted           410  a version whose weights retention evicted, or are gone
    ├── SessionNotOpen           409  the session takes no more turns
    ├── RewardsClosed            409  the session takes no more rewards (claimed, settled)
    ├── RewardConflict           409  a different reward was already posted for that target
    ├── GroupMixesEval           409  a group_id holds sessions of another kind (eval, production)
    ├── PromotionRefused         409  a promotion a full-weight run's engines could not serve
    ├── WeightsConflict          409  a swap's version is served, but not with the weights it names
    ├── EnginesShared            409  full weights and LoRA adapters would need the same engines
    ├── VersionNotServable       409  a pin to a full-weight run's version other than its current
    ├── VersionSuperseded        409  a publish under a number a later version (a rollback) took
    ├── RollbackRefused          409  a rollback to the current version or a later one
    ├── StalenessBound           429  the run's admission is full (Retry-After)
    ├── Overloaded               503  requests or connections at their bound (Retry-After)
    ├── NoEngineAvailable        503  no engine in rotation could serve (Retry-After)
    │   └── ContextLengthUnknown 503  no engine has reported its context length yet
    ├── StoreUnavailable         503  the store is full, read-only, locked or away (Retry-After)
    ├── NoLeader                 503  no replica leads now to swap the weights (Retry-After)
    ├── EngineError              503  the engine serving the request failed (Retry-After)
    │   ├── EngineUnavailable    503  it timed out, broke off or answered 5xx: another may serve
    │   │   └── EngineTimedOut   503  it took longer than --request-timeout-s: not tried again
    │   └── EngineRejected       400  it refused the request (4xx): no other engine would take it
    └── WeightUpdateFailed       502  an engine failed to load weights or join a weight group
        ├── WeightsRefused       400  unreadable weight files, or every engine refused them
        ├── RendezvousUnreachable 422 the trainer's rendezvous does not answer
        ├── WeightGroupRefused   422  an engine refused the weight group's values
        └── NoEngineToUpdate     503  no engine in rotation to update

Only this module knows statuses. It imports no web framework at its top, so the store and the
engine client raise these without loading FastAPI (``install`` imports it when the app is
built).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "The server hit an internal error; it has been logged."


class ProxrlError(Exception):
    """The root: what the client reads is ``message`` (the table's lead, then ``detail``, which
    is also ``str(exc)``), with ``param`` and ``code``; ``status``, ``type`` and ``headers``
    come from ``RENDERING``."""

    def __init__(
        self,
        detail: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(detail)
        rendering = rendering_of(type(self))
        self.message = rendering.lead + detail
        self.param = param
        self.code = code if code is not None else rendering.code
        self.status, self.type = rendering.status, rendering.type
        retry = retry_after_s if retry_after_s is not None else rendering.retry_after_s
        self.headers = {"Retry-After": str(retry)} if retry is not None else None


class InvalidRequest(ProxrlError):
    pass


class PromptTooLong(InvalidRequest):
    pass


class InvalidConfig(ProxrlError):
    pass


class NotInClaim(ProxrlError):
    def __init__(self, claim_id: str, session_ids: list[str]) -> None:
        super().__init__(
            f"Sessions named in dropped are not in claim {claim_id!r}: "
            f"{', '.join(session_ids[:20])}.",
            param="dropped",
        )
        self.session_ids = session_ids


class AuthenticationRequired(ProxrlError):
    pass


class InvalidKey(AuthenticationRequired):
    def __init__(self) -> None:
        super().__init__("Invalid API key.")


class KeyOutOfScope(ProxrlError):
    pass


class BodyTooLarge(ProxrlError):
    """A request body over its route's limit (``server.limits``), refused before it is read
    whole."""


class ResourceNotFound(ProxrlError):
    pass


class RunNotFound(ResourceNotFound):
    def __init__(self, run_id: str | None) -> None:
        super().__init__(f"No run {run_id!r}.")


class SessionNotFound(ResourceNotFound):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"No session {session_id!r}.")


class ClaimNotFound(ResourceNotFound):
    def __init__(self, claim_id: str) -> None:
        super().__init__(f"No claim {claim_id!r}: no session carries that claim id.")


class CompletionNotFound(ResourceNotFound):
    def __init__(self, completion_id: str) -> None:
        message = f"no turn with completion_id {completion_id!r} in this session"
        super().__init__(message, param="completion_id")


class ResponseNotFound(ResourceNotFound):
    def __init__(self, response_id: str, param: str | None = None) -> None:
        message = f"No response found with id {response_id!r}."
        super().__init__(message, param=param)


class ModelNotFound(ResourceNotFound):
    def __init__(self, model: str, served: list[str]) -> None:
        names = ", ".join(f"'{name}'" for name in served)
        message = f"The model '{model}' does not exist; this run serves {names}."
        super().__init__(message, param="model")


class VersionNotFound(ResourceNotFound):
    def __init__(self, run_id: str, version: int, param: str | None = "version") -> None:
        super().__init__(f"Run {run_id!r} never published version {version}.", param=param)


class VersionEvicted(ProxrlError):
    """A version of a run that cannot be served again: retention evicted it, or its weight files
    are gone (``message`` says which). Its row stays, as the lineage's."""

    def __init__(self, message: str, param: str | None = "version") -> None:
        super().__init__(message, param=param)


class VersionNotServable(ProxrlError):
    def __init__(self, run_id: str, version: int, current: int, param: str = "model") -> None:
        super().__init__(
            f"Run {run_id!r} trains full weights and serves only its current version "
            f"({current}), not version {version}: a full-weight run's engines serve only its "
            "current version; pin versions of LoRA runs.",
            param=param,
        )


class SessionNotOpen(ProxrlError):
    def __init__(self, status: str) -> None:
        super().__init__(f"The session is {status}; it takes no more turns.")


class RewardsClosed(ProxrlError):
    def __init__(self, status: str) -> None:
        super().__init__(f"the session is {status}; it takes no more rewards")
        self.session_status = status


class RewardConflict(ProxrlError):
    def __init__(self, existing: float) -> None:
        message = f"a different reward ({existing}) was already posted for this target"
        super().__init__(message, param="reward")
        self.existing = existing


class GroupMixesEval(ProxrlError):
    def __init__(self, group_id: str, holds: str) -> None:
        """``holds``: "training", "eval" or "production", a kind of session the group already
        holds."""
        super().__init__(
            f"group_id {group_id!r} holds {holds} sessions; a session of another kind cannot "
            "join it (a GRPO group's sessions are all training, all eval or all production "
            "sessions): use another group_id.",
            param="group_id",
        )


class PromotionRefused(ProxrlError):
    """A promotion gate, a promotion or a full-weight publish that would have a full-weight
    run's production sessions served a version its engines do not serve: they serve one set of
    full weights, the current version's."""

    def __init__(self, message: str, param: str | None = "version") -> None:
        super().__init__(message, param=param)


class WeightsConflict(ProxrlError):
    """A swap names the version the engines serve, but other weights than were loaded as that
    version (another path, or another run's swap to the same number): nothing is swapped."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="version")


class EnginesShared(ProxrlError):
    """A publish of full weights where LoRA runs' adapters are served on the base model, or of
    an adapter where a run's full weights replaced the base: one set of engines serves one base
    model, so the two kinds of run cannot share it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param=param)


class VersionSuperseded(ProxrlError):
    """A publish that names a version number the run has passed (or reached with other weights),
    as a trainer does that has not yet seen a rollback: recording it would rewrite the lineage,
    so nothing is loaded. The trainer reads the run's versions and follows the rollback."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="version")


class RollbackRefused(ProxrlError):
    """A rollback to the run's current version, or to one above it: only an earlier version can
    be made current again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="version")


class StalenessBound(ProxrlError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            "The run is at its staleness bound: generation is ahead of training. "
            "Retry once the trainer has trained (or dropped) sessions it holds.",
            retry_after_s=retry_after_s,
        )


class Overloaded(ProxrlError):
    """At a bound of ``server.overload``: the requests in flight of the caller's class, or
    the connections the server holds."""


class NoEngineAvailable(ProxrlError):
    pass


class ContextLengthUnknown(NoEngineAvailable):
    def __init__(self) -> None:
        super().__init__(
            "No engine has reported its context length, so no engine can serve; "
            "see GET /admin/engines."
        )


class StoreUnavailable(ProxrlError):
    """The store cannot take the request now (``store.database.store_fault`` says why): retrying
    later may succeed, and nothing the client was answered is lost."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"it is {reason}. Nothing of this request was kept; retry later.")
        self.reason = reason


class NoLeader(ProxrlError):
    """A weight swap reached a follower replica while no replica leads (the last leader died
    and none has taken over yet), or the leader could not be reached: retrying soon may
    succeed."""


class EngineError(ProxrlError):
    pass


class EngineUnavailable(EngineError):
    """The engine did not answer, answered 5xx, or broke off: another engine may serve."""


class EngineTimedOut(EngineUnavailable):
    """The engine did not finish within the proxy's request timeout: the request's time is
    spent, so it is neither resumed nor sent to another engine."""


class EngineRejected(EngineError):
    """The engine refused the request (4xx): retrying elsewhere would not help."""

    def __init__(self, engine_status: int, detail: str) -> None:
        super().__init__(detail)
        self.engine_status = engine_status


class WeightUpdateFailed(ProxrlError):
    pass


class WeightsRefused(WeightUpdateFailed):
    pass


class RendezvousUnreachable(WeightUpdateFailed):
    pass


class WeightGroupRefused(WeightUpdateFailed):
    pass


class NoEngineToUpdate(WeightUpdateFailed):
    pass


@dataclass(frozen=True)
class Rendering:
    """How the client sees one kind of error. ``lead`` comes before the raiser's detail (the
    engine's own words, say); ``retry_after_s``: the Retry-After header, where retrying may
    help."""

    status: int
    type: str
    code: str | None = None
    retry_after_s: int | None = None
    lead: str = ""


_INVALID = "invalid_request_error"
_UNAVAILABLE = "service_unavailable"
# An engine may be back at the next health check (or the next request's probe): retry soon.
_ENGINE_RETRY_S = 1
# A store fault (a disk filling, a database restarting) takes longer to clear.
_STORE_RETRY_S = 2

RENDERING: dict[type[ProxrlError], Rendering] = {
    ProxrlError: Rendering(500, "server_error"),
    InvalidRequest: Rendering(400, _INVALID),
    PromptTooLong: Rendering(400, _INVALID, "context_length_exceeded"),
    InvalidConfig: Rendering(422, _INVALID, lead="Invalid run config: "),
    NotInClaim: Rendering(422, _INVALID, "not_in_claim"),
    AuthenticationRequired: Rendering(401, "authentication_error"),
    InvalidKey: Rendering(401, "authentication_error", "invalid_api_key"),
    KeyOutOfScope: Rendering(403, "permission_error"),
    BodyTooLarge: Rendering(413, "request_too_large", "request_too_large"),
    ResourceNotFound: Rendering(404, "not_found_error"),
    RunNotFound: Rendering(404, "not_found_error", "run_not_found"),
    SessionNotFound: Rendering(404, "not_found_error", "session_not_found"),
    ClaimNotFound: Rendering(404, "not_found_error", "claim_not_found"),
    CompletionNotFound: Rendering(404, "not_found_error", "completion_not_found"),
    ResponseNotFound: Rendering(404, "not_found_error", "response_not_found"),
    ModelNotFound: Rendering(404, "not_found_error", "model_not_found"),
    VersionNotServable: Rendering(409, "conflict_error", "version_not_servable"),
    VersionNotFound: Rendering(404, "not_found_error", "version_not_found"),
    VersionEvicted: Rendering(410, "gone_error", "version_evicted"),
    SessionNotOpen: Rendering(409, "conflict_error", "session_closed"),
    RewardsClosed: Rendering(409, "conflict_error", "rewards_closed"),
    RewardConflict: Rendering(409, "conflict_error", "reward_conflict"),
    GroupMixesEval: Rendering(409, "conflict_error", "group_mixes_eval"),
    PromotionRefused: Rendering(409, "conflict_error", "promotion_refused"),
    WeightsConflict: Rendering(409, "conflict_error", "weights_conflict"),
    EnginesShared: Rendering(409, "conflict_error", "engines_shared"),
    VersionSuperseded: Rendering(409, "conflict_error", "version_superseded"),
    RollbackRefused: Rendering(409, "conflict_error", "rollback_refused"),
    StalenessBound: Rendering(429, "rate_limit_error", "staleness_bound", retry_after_s=1),
    Overloaded: Rendering(
        503, _UNAVAILABLE, "overloaded", 1, lead="The server is at its bound of requests: "
    ),
    NoEngineAvailable: Rendering(
        503,
        _UNAVAILABLE,
        "no_engine_available",
        _ENGINE_RETRY_S,
        lead="No engine could serve this request: ",
    ),
    ContextLengthUnknown: Rendering(503, _UNAVAILABLE, "no_engine_available", _ENGINE_RETRY_S),
    StoreUnavailable: Rendering(
        503,
        _UNAVAILABLE,
        "store_unavailable",
        _STORE_RETRY_S,
        lead="The store cannot serve this request now: ",
    ),
    NoLeader: Rendering(
        503,
        _UNAVAILABLE,
        "no_leader",
        _ENGINE_RETRY_S,
        lead="No replica could swap the weights now: ",
    ),
    EngineError: Rendering(
        503,
        _UNAVAILABLE,
        "engine_unavailable",
        _ENGINE_RETRY_S,
        lead="The engine serving this request failed: ",
    ),
    EngineUnavailable: Rendering(
        503,
        _UNAVAILABLE,
        "engine_unavailable",
        _ENGINE_RETRY_S,
        lead="The engine serving this request failed: ",
    ),
    EngineTimedOut: Rendering(
        503,
        _UNAVAILABLE,
        "engine_timeout",
        _ENGINE_RETRY_S,
        lead="The engine serving this request failed: ",
    ),
    EngineRejected: Rendering(
        400, _INVALID, "engine_rejected", lead="The engine refused the request: "
    ),
    WeightUpdateFailed: Rendering(502, "engine_error"),
    WeightsRefused: Rendering(400, _INVALID),
    RendezvousUnreachable: Rendering(422, _INVALID, "rendezvous_unreachable"),
    WeightGroupRefused: Rendering(422, _INVALID, "engine_refused"),
    NoEngineToUpdate: Rendering(503, _UNAVAILABLE),
}


def rendering_of(kind: type[ProxrlError]) -> Rendering:
    """The table's entry for ``kind``, or for its nearest ancestor (a subclass made elsewhere)."""
    for ancestor in kind.__mro__:
        if ancestor in RENDERING:
            return RENDERING[ancestor]  # type: ignore[index]
    raise AssertionError(f"{kind.__name__} is not a ProxrlError")


# The error type of each status (one per status: a unit test holds the table to it), for the
# refusals the framework makes itself (an unknown path, a method no route has).
TYPE_OF_STATUS = {rendering.status: rendering.type for rendering in RENDERING.values()}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def body_of(exc: ProxrlError) -> dict[str, Any]:
    return error_body(exc.message, exc.type, exc.param, exc.code)


@dataclass(frozen=True)
class ErrorShape:
    """Another API's error shape on the routes whose path ``matches``: the ``body`` for a
    message, status and param, and the ``model`` the OpenAPI document gives it."""

    matches: Callable[[str], bool]
    body: Callable[[str, int, str | None], dict[str, Any]]
    model: type[BaseModel]


# ----- rendering in the app (FastAPI is imported when the app is built, not here) -----------


def _is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith("/sessions/")


def _answer(
    request: Request, status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The error ``body`` (OpenAI's shape), in another where an ``ErrorShape`` claims the path."""
    from fastapi.responses import JSONResponse

    for shape in getattr(request.app.state, "error_shapes", ()):
        if shape.matches(request.url.path):
            body = shape.body(body["error"]["message"], status, body["error"]["param"])
            break
    return JSONResponse(body, status_code=status, headers=headers)


def render(request: Request, exc: ProxrlError) -> JSONResponse:
    """The answer to ``exc`` on ``request``'s route, in its API's shape."""
    return _answer(request, exc.status, body_of(exc), exc.headers)


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProxrlError)
    return render(request, exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    from fastapi.exceptions import RequestValidationError

    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    # Of a union's branches, the one whose type matched says what to fix ("at most 16 items"),
    # not the ones of another type ("Input should be a valid string").
    telling = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    first = (telling or errors or [{"loc": (), "msg": "invalid request"}])[0]
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = "The request body is not valid JSON."
    else:
        message = f"{first.get('msg')}" + (f" (at {param})" if param else "")
    # OpenAI answers bad parameters with 400; the REST API follows FastAPI's 422.
    openai = _is_openai_path(request.url.path)
    status = 400 if openai or first.get("type") == "json_invalid" else 422
    return _answer(request, status, error_body(message, _INVALID, param))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own refusals (an unknown path, a method no route has, a body
    that cannot be decoded) in our shape rather than ``{"detail": ...}``."""
    from starlette.exceptions import HTTPException

    assert isinstance(exc, HTTPException)
    kind = TYPE_OF_STATUS.get(exc.status_code, _INVALID)
    body = error_body(str(exc.detail), kind)
    return _answer(request, exc.status_code, body, exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return await _domain_error(request, ProxrlError(INTERNAL_MESSAGE))


class _KeepConnection:
    """ASGI middleware: an unhandled error, before its response started, answered here as
    ``_unexpected`` does, and not raised on. Starlette's outermost layer answers it too but then
    raises it again, and uvicorn closes the connection of a request that raised: the client's
    next request on that pooled connection would fail in transit. (After the response started,
    the connection cannot be saved: the exception goes on.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request

        started = False

        async def send_noting(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        except Exception as exc:
            if started:
                raise
            response = await _unexpected(Request(scope), exc)
            await response(scope, receive, send)


def install(app: FastAPI, shapes: Sequence[ErrorShape] = ()) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app.add_exception_handler(ProxrlError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(_KeepConnection)
    app.state.error_shapes = tuple(shapes)
    app.openapi = _documenting_validation(app, shapes)  # type: ignore[method-assign]


# ----- the OpenAPI document --------------------------------------------------------------------


def _documenting_validation(
    app: FastAPI, shapes: Sequence[ErrorShape]
) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` with request-validation errors as ``_validation_error`` sends them: our
    error shape (not FastAPI's HTTPValidationError), 422 on REST routes and 400 on OpenAI ones;
    and a 413 on every route that takes a body (its limit, ``server.limits``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        for path, operations in document.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "requestBody" in operation:  # server.limits answers before the route
                    shape = next((s.model for s in shapes if s.matches(path)), ErrorBody)
                    responses.setdefault("413", _error_response("413", document, shape))
                if "HTTPValidationError" not in str(responses.get("422", "")):
                    continue
                del responses["422"]
                status = "400" if _is_openai_path(path) else "422"
                shape = next((s.model for s in shapes if s.matches(path)), ErrorBody)
                responses.setdefault(status, _error_response(status, document, shape))
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = document
        return document

    return openapi


def _error_response(status: str, document: dict[str, Any], shape: type[BaseModel]) -> dict:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in shape.model_json_schema(ref_template=REF).get("$defs", {}).items():
        schemas.setdefault(name, schema)
    body = shape.model_json_schema(ref_template=REF)
    body.pop("$defs", None)
    schemas.setdefault(shape.__name__, body)
    return {
        "description": MEANINGS[int(status)],
        "content": {"application/json": {"schema": {"$ref": REF.format(model=shape.__name__)}}},
    }


REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, and what to change.")
    type: str = Field(description="The kind of error, e.g. invalid_request_error.")
    param: str | None = Field(description="The parameter at fault (null: none in particular).")
    code: str | None = Field(description="A stable code for programs (null: none).")


class ErrorBody(BaseModel):
    """Every error answer's body, on every route whose path no ``ErrorShape`` claims (also
    request-validation errors)."""

    error: ErrorDetail


# What each status means to a client reading the API document.
MEANINGS = {
    400: "Bad request: the message says what to fix.",
    401: "No key, or a key proxrl did not issue.",
    403: "The key may not do this.",
    404: "No such resource.",
    409: "The resource's state does not allow this now.",
    410: "The resource existed but is gone for good (an evicted version).",
    413: "The request is larger than the server takes.",
    422: "A field is missing or out of its bounds (see param).",
    429: "Not admitted now (the run's staleness bound); try again after Retry-After seconds.",
    502: "An engine failed the request.",
    503: "Not now: no engine in rotation, or the store unavailable; retry after Retry-After.",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer"},
    }
}
_RETRIED = {r.status for r in RENDERING.values() if r.retry_after_s is not None}


def documented(
    *statuses: int, shape: type[BaseModel] = ErrorBody
) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that can answer ``statuses`` in the error ``shape`` (with
    the Retry-After header where an error of that status carries one)."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": shape, "description": MEANINGS[status]}
        if status in _RETRIED:
            entry["headers"] = _RETRY_AFTER
        responses[status] = entry
    return responses
