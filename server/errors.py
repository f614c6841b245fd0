"""Domain errors, rendered in one place in OpenAI's shape: {"error": {message, type, param, code}}.

Domain modules raise these (never HTTPException); ``install`` maps them, request validation
errors and anything unexpected to JSON responses. Bad input always gets a 4xx that says what to
fix; a bug gets a 500 that says so without leaking internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ProxyError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.headers = message, param, code, headers


class BadRequest(ProxyError):
    status, type = 400, "invalid_request_error"


class Unauthorized(ProxyError):
    status, type = 401, "authentication_error"


class Forbidden(ProxyError):
    status, type = 403, "permission_error"


class NotFound(ProxyError):
    status, type = 404, "not_found_error"


class Conflict(ProxyError):
    status, type = 409, "conflict_error"


class Unprocessable(ProxyError):
    status, type = 422, "invalid_request_error"


class TooManyRequests(ProxyError):
    status, type = 429, "rate_limit_error"


class BadGateway(ProxyError):
    status, type = 502, "engine_error"


class Unavailable(ProxyError):
    status, type = 503, "service_unavailable"


ERROR_TYPES = {
    kind.status: kind.type
    for kind in (Unauthorized, Forbidden, NotFound, Conflict, TooManyRequests, Unavailable)
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _is_openai_route(request: Request) -> bool:
    return _is_openai_path(request.url.path)


def _is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith("/sessions/")


async def _proxy_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProxyError)
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
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
    status = 400 if _is_openai_route(request) or first.get("type") == "json_invalid" else 422
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own refusals (an unknown path, a method no route has, a body
    that cannot be decoded) in our shape rather than ``{"detail": ...}``."""
    assert isinstance(exc, StarletteHTTPException)
    kind = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    body = error_body(str(exc.detail), kind)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = error_body("The server hit an internal error; it has been logged.", "server_error")
    return JSONResponse(body, status_code=500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ProxyError, _proxy_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.openapi = _documenting_validation(app)  # type: ignore[method-assign]


def _documenting_validation(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` with request-validation errors as ``_validation_error`` sends them: our
    error shape (not FastAPI's HTTPValidationError), 422 on REST routes and 400 on OpenAI ones."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        for path, operations in document.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "HTTPValidationError" not in str(responses.get("422", "")):
                    continue
                del responses["422"]
                status = "400" if _is_openai_path(path) else "422"
                responses.setdefault(status, _error_response(status, document))
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = document
        return document

    return openapi


def _error_response(status: str, document: dict[str, Any]) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in ErrorBody.model_json_schema(ref_template=REF).get("$defs", {}).items():
        schemas.setdefault(name, schema)
    body = ErrorBody.model_json_schema(ref_template=REF)
    body.pop("$defs", None)
    schemas.setdefault("ErrorBody", body)
    return {
        "description": _MEANINGS[int(status)],
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}},
    }


REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, and what to change.")
    type: str = Field(description="The kind of error, e.g. invalid_request_error.")
    param: str | None = Field(description="The parameter at fault (null: none in particular).")
    code: str | None = Field(description="A stable code for programs (null: none).")


class ErrorBody(BaseModel):
    """Every error answer's body, on every route (also request-validation errors)."""

    error: ErrorDetail


_MEANINGS = {
    400: "Bad request: the message says what to fix.",
    401: "No key, or a key proxrl did not issue.",
    403: "The key may not do this.",
    404: "No such resource.",
    409: "The resource's state does not allow this now.",
    413: "The request is larger than the server takes.",
    422: "A field is missing or out of its bounds (see param).",
    429: "Not admitted now (the run's staleness bound); try again after Retry-After seconds.",
    502: "An engine failed the request.",
    503: "No engine is in rotation to serve it.",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer"},
    }
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that can answer ``statuses`` in the error shape."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": _MEANINGS[status]}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
        responses[status] = entry
    return responses
