"""Domain errors, rendered in one place in OpenAI's shape: {"error": {message, type, param, code}}.

Domain modules raise these (never HTTPException); ``install`` maps them, request validation
errors and anything unexpected to JSON responses. Bad input always gets a 4xx that says what to
fix; a bug gets a 500 that says so without leaking internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _is_openai_route(request: Request) -> bool:
    path = request.url.path
    return path.startswith("/v1/") or path.startswith("/sessions/")


async def _proxy_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProxyError)
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = "The request body is not valid JSON."
    else:
        message = f"{first.get('msg')}" + (f" (at {param})" if param else "")
    # OpenAI answers bad parameters with 400; the REST API follows FastAPI's 422.
    status = 400 if _is_openai_route(request) or first.get("type") == "json_invalid" else 422
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=status)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = error_body("The server hit an internal error; it has been logged.", "server_error")
    return JSONResponse(body, status_code=500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ProxyError, _proxy_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
