"""Errors in the API's terms (``server.proxy.streaming.api_error``) and the error event a
stream ends with: OpenAI's shape and type names, never a Python class name."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from server.errors import (
    EngineError,
    EngineRejected,
    EngineUnavailable,
    NoEngineAvailable,
    NoEngineToUpdate,
    SessionNotOpen,
)
from server.proxy.outputs import OpenAIRenderer
from server.proxy.streaming import api_error, guarded, sse

# (the exception, the status, type and code the client gets for it)
CASES = [
    (NoEngineAvailable("gone"), 503, "service_unavailable", "no_engine_available"),
    (EngineUnavailable("timed out"), 503, "service_unavailable", "engine_unavailable"),
    (EngineError("broke"), 503, "service_unavailable", "engine_unavailable"),
    (EngineRejected(400, "too long"), 400, "invalid_request_error", "engine_rejected"),
    (SessionNotOpen("ended"), 409, "conflict_error", "session_closed"),
    (RuntimeError("a bug"), 500, "server_error", None),
    (KeyError("turn"), 500, "server_error", None),
]


@pytest.mark.parametrize(("exc", "status", "type_", "code"), CASES)
def test_every_failure_has_an_api_type_and_code(exc, status, type_, code):
    error = api_error(exc)
    assert (error.status, error.type, error.code) == (status, type_, code)
    assert error.message


def test_an_engine_outage_says_when_to_retry():
    for exc in (NoEngineAvailable("gone"), EngineUnavailable("timed out")):
        assert int(api_error(exc).headers["Retry-After"]) >= 1
    assert NoEngineToUpdate("x").headers is None  # only where retrying may help


def test_an_unexpected_error_is_logged_with_its_traceback_and_not_shown(caplog):
    with caplog.at_level(logging.ERROR, logger="server.proxy.streaming"):
        error = api_error(RuntimeError("secret internals"))
    assert "secret internals" not in error.message
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[1].args == ("secret internals",)


def _events_until(exc: Exception) -> list:
    async def events() -> AsyncIterator[str]:
        yield 'data: {"first": 1}\n\n'
        raise exc

    async def run() -> list:
        work = asyncio.create_task(asyncio.sleep(60))

        def on_error(error: Exception) -> str:
            return "".join(sse(event) for event in OpenAIRenderer.error(error))

        done = "".join(sse(event) for event in OpenAIRenderer.closing())
        out = [event async for event in guarded(events(), work, on_error, done)]
        assert work.cancelled() or work.cancelling()
        return out

    return asyncio.run(run())


@pytest.mark.parametrize(("exc", "status", "type_", "code"), CASES)
def test_a_stream_ends_with_a_well_formed_error_event_then_done(exc, status, type_, code):
    first, last = _events_until(exc)  # the error event and [DONE] go out in one write
    error_event, done = last.removesuffix("data: [DONE]\n\n"), "data: [DONE]\n\n"
    assert first == 'data: {"first": 1}\n\n' and last == error_event + done
    assert error_event.endswith("\n\n") and error_event.count("\n\n") == 1
    body = json.loads(error_event.removeprefix("data: "))
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["code"] == code
    assert body["error"]["type"] != type(exc).__name__
