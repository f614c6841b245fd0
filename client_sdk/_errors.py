"""Every error the SDK raises, in one tree::

    ProxrlError                      anything from this SDK (also: no base URL or key configured)
    ├── APIConnectionError           no HTTP answer: refused, reset, DNS, TLS ...
    │   └── APITimeoutError          the request ran past its httpx.Timeout
    └── APIStatusError               the server answered with a 4xx or 5xx
        ├── BadRequestError          400
        ├── AuthenticationError      401  missing or unknown key
        ├── PermissionDeniedError    403  the key cannot reach that run or session
        ├── NotFoundError            404  no such run, session or completion
        ├── ConflictError            409  a different reward already posted, session closed
        ├── UnprocessableEntityError 422  a body or run config that does not validate
        ├── RateLimitError           429  the run is at its staleness bound (``retry_after``)
        └── InternalServerError      5xx

An ``APIStatusError`` carries the ``status_code``, the ``response``, and the fields of the
server's OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``; a body of
another shape (a proxy in between, say) leaves ``type`` and ``code`` None and puts the text in
``message``. This module knows nothing about retries: the clients decide what to retry and
raise these once they give up.
"""

from __future__ import annotations

from typing import Any

import httpx


class ProxrlError(Exception):
    """Base class of every error raised by client_sdk."""


class APIConnectionError(ProxrlError):
    """The request got no HTTP answer."""

    def __init__(self, message: str = "Connection error.", *, request: httpx.Request | None = None):
        super().__init__(message)
        self.message = message
        self.request = request


class APITimeoutError(APIConnectionError):
    """The request timed out (see the client's ``timeout``)."""

    def __init__(
        self, message: str = "Request timed out.", *, request: httpx.Request | None = None
    ):
        super().__init__(message, request=request)


class APIStatusError(ProxrlError):
    """The server answered with an error status."""

    def __init__(self, message: str, *, response: httpx.Response, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.status_code: int = response.status_code
        self.response = response
        self.body = body
        self.message: str = message
        self.type: str | None = error.get("type")
        self.code: str | None = error.get("code")
        self.param: str | None = error.get("param")
        super().__init__(f"{self.status_code} {self.code or self.type or 'error'}: {message}")


class BadRequestError(APIStatusError):
    """400."""


class AuthenticationError(APIStatusError):
    """401: no key, or a key the server did not issue."""


class PermissionDeniedError(APIStatusError):
    """403: a valid key that cannot reach this run or session (or is not the admin key)."""


class NotFoundError(APIStatusError):
    """404."""


class ConflictError(APIStatusError):
    """409: e.g. a different reward for the same target, or a session that takes no more."""


class UnprocessableEntityError(APIStatusError):
    """422: a body or run config that does not validate; ``message`` names the field."""


class RateLimitError(APIStatusError):
    """429: the run is at its staleness bound. ``retry_after`` is the server's Retry-After in
    seconds (None when absent)."""

    def __init__(
        self, message: str, *, response: httpx.Response, body: Any, retry_after: float | None
    ) -> None:
        super().__init__(message, response=response, body=body)
        self.retry_after = retry_after


class InternalServerError(APIStatusError):
    """5xx: a server bug (500), an engine failure (502) or no engine available (503)."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
}


def parse_retry_after(response: httpx.Response) -> float | None:
    """The Retry-After header in seconds (a number or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    from datetime import UTC, datetime

    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The exception for an error response (the caller raises it)."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        message = str(error["message"])
    elif isinstance(body, dict) and isinstance(body.get("detail"), str):
        message = body["detail"]  # a route the server does not have (FastAPI's shape)
    else:
        message = (body if isinstance(body, str) else response.text) or response.reason_phrase
    status = response.status_code
    if status == 429:
        return RateLimitError(
            message, response=response, body=body, retry_after=parse_retry_after(response)
        )
    if status >= 500:
        return InternalServerError(message, response=response, body=body)
    return _BY_STATUS.get(status, APIStatusError)(message, response=response, body=body)
