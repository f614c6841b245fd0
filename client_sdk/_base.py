"""What the sync and async clients share, free of I/O: configuration (arguments, then the
environment), the retry policy, request bodies, and what a session knows about itself.

Nothing here sends a request or sleeps; ``_client`` and ``_async_client`` do, each in its own
way, so that the two stay mirror twins that differ only in ``await``.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from client_sdk._errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ProxrlError,
    RateLimitError,
    parse_retry_after,
)
from client_sdk._types import RunMetrics, SessionCreated

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

    from client_sdk._types import Run

log = logging.getLogger("client_sdk")

BASE_URL_ENV = "PROXRL_BASE_URL"
ADMIN_KEY_ENV = "PROXRL_ADMIN_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Creating a session may wait up to the run's admission_wait_s (30 s by default) before the
# server answers, so the read timeout must be longer than that.
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
# A Retry-After longer than this is not waited out silently: the error goes to the caller.
MAX_RETRY_AFTER_S = 60.0
USER_AGENT = "proxrl-client-sdk/0.1"


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    admin_key: str
    timeout: httpx.Timeout
    max_retries: int

    def http_options(self) -> dict[str, Any]:
        """Keyword arguments for httpx.Client / httpx.AsyncClient."""
        return {
            "base_url": self.base_url,
            "timeout": self.timeout,
            "headers": {
                "Authorization": f"Bearer {self.admin_key}",
                "User-Agent": USER_AGENT,
            },
        }


def resolve_config(
    base_url: str | None,
    admin_key: str | None,
    timeout: float | httpx.Timeout,
    max_retries: int,
) -> ClientConfig:
    """Arguments first, then PROXRL_BASE_URL / PROXRL_ADMIN_KEY; a missing key is an error."""
    url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    key = admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise ProxrlError(
            f"No admin key: pass admin_key=... or set {ADMIN_KEY_ENV} "
            "(a run key works too, for that run's sessions)."
        )
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, not {max_retries!r}")
    if not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout)
    return ClientConfig(url.rstrip("/"), key, timeout, max_retries)


# --------------------------------------------------------------------------------------------
# retries


def is_retryable(error: ProxrlError) -> bool:
    """No answer, a timeout, 408, 429 (admission) or any 5xx. Other 4xx say what to fix."""
    if isinstance(error, APIConnectionError):
        return True
    if isinstance(error, APIStatusError):
        return error.status_code in (408, 429) or error.status_code >= 500
    return False


def backoff_delay(retries_taken: int) -> float:
    """Exponential backoff from INITIAL_RETRY_DELAY_S, capped, with up to 25% jitter down."""
    delay = min(INITIAL_RETRY_DELAY_S * 2.0**retries_taken, MAX_RETRY_DELAY_S)
    return delay * (1.0 - 0.25 * random.random())


def retry_delay(retries_taken: int, max_retries: int, error: ProxrlError) -> float | None:
    """Seconds to wait before trying again after ``error``, or None to raise it now.

    A Retry-After (seconds or an HTTP date) is honoured: the wait is never shorter, and up to
    10% longer so that clients refused together do not all come back at the same instant. One
    longer than MAX_RETRY_AFTER_S is not waited out: the caller gets the error at once.
    """
    if retries_taken >= max_retries or not is_retryable(error):
        return None
    if isinstance(error, RateLimitError):
        retry_after = error.retry_after
    elif isinstance(error, APIStatusError):
        retry_after = parse_retry_after(error.response)
    else:
        retry_after = None
    if retry_after is None:
        return backoff_delay(retries_taken)
    if retry_after > MAX_RETRY_AFTER_S:
        return None
    return retry_after * (1.0 + 0.1 * random.random())


def connection_error(exc: httpx.TransportError) -> APIConnectionError:
    request = _request_of(exc)
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"Request timed out: {exc!r}", request=request)
    return APIConnectionError(f"Connection error: {exc!r}", request=request)


def _request_of(exc: httpx.TransportError) -> httpx.Request | None:
    try:
        return exc.request
    except RuntimeError:  # raised by httpx when the error carries no request
        return None


def log_retry(method: str, path: str, error: ProxrlError, delay: float, retry: int, of: int):
    log.info(
        "retrying %s %s in %.2fs after %s (retry %d of %d)", method, path, delay, error, retry, of
    )


# --------------------------------------------------------------------------------------------
# requests


def segment(value: str) -> str:
    """An id as one path segment."""
    return quote(value, safe="")


def run_body(name: str, config: dict[str, Any] | None) -> dict[str, Any]:
    return {"name": name, "config": config or {}}


def session_body(
    run_id: str | None,
    task_id: str | None,
    group_id: str | None,
    metadata: dict[str, Any] | None,
    eval: bool = False,
    production: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {"run_id": run_id, "task_id": task_id, "group_id": group_id}
    body = {key: value for key, value in body.items() if value is not None}
    if metadata is not None:
        body["metadata"] = metadata
    if eval:
        body["eval"] = True
    if production:
        body["production"] = True
    return body


def reward_body(value: float, completion_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"reward": value}
    if completion_id is not None:
        body["completion_id"] = completion_id
    return body


def metrics_of(run: Run) -> RunMetrics:
    return {
        "run_id": run["id"],
        "policy_version": run["policy_version"],
        "sessions": run["sessions"],
        "totals": run["totals"],
    }


# --------------------------------------------------------------------------------------------
# sessions


class SessionBase:
    """What a session knows about itself once created, and the OpenAI clients pointed at it.

    ``Session`` and ``AsyncSession`` add the calls (reward, end, get) in their own style."""

    _created: SessionCreated | None = None

    @property
    def created(self) -> SessionCreated:
        """The server's answer to the creation (its key included)."""
        if self._created is None:
            raise ProxrlError("The session is not created yet: await it or use `async with`.")
        return self._created

    @property
    def id(self) -> str:
        return self.created["session_id"]

    @property
    def api_key(self) -> str:
        """The session's own key: the OpenAI api_key of its agent."""
        return self.created["api_key"]

    @property
    def base_url(self) -> str:
        """Where the agent's OpenAI client points (the server's answer; it ends in /v1)."""
        return self.created["base_url"]

    @property
    def run_id(self) -> str:
        return self.created["run_id"]

    def openai(self, **kwargs: Any) -> OpenAI:
        """A stock ``openai.OpenAI`` on this session; ``kwargs`` go to its constructor. The
        caller owns it: close it, or use it as a context manager."""
        from openai import OpenAI

        return OpenAI(**{"base_url": self.base_url, "api_key": self.api_key, **kwargs})

    def async_openai(self, **kwargs: Any) -> AsyncOpenAI:
        """A stock ``openai.AsyncOpenAI`` on this session; the caller owns it."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(**{"base_url": self.base_url, "api_key": self.api_key, **kwargs})

    def __repr__(self) -> str:
        if self._created is None:
            return f"<{type(self).__name__} (not created yet)>"
        return f"<{type(self).__name__} {self.id} run={self.run_id}>"
