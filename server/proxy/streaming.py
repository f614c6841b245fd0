"""Server-sent events for the OpenAI-style streams: framing, pumping sampled pieces out, and
what a failure means for the client (``api_error``: the same error before a stream starts, as
a status code, and in it, as an error event)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.engine_client.client import EngineError, EngineRejected
from server.engine_client.pool import NoEngineAvailable
from server.errors import BadRequest, ProxyError, Unavailable, error_body

log = logging.getLogger(__name__)

# An engine may be back at the next health check (or the next request's probe): retry soon.
RETRY_AFTER = {"Retry-After": "1"}

# What an engine-side failure means for the client: one entry per kind, the most specific
# first in each exception's own class hierarchy (see ``api_error``).
ENGINE_FAILURES: dict[type[Exception], Callable[[Exception], ProxyError]] = {
    NoEngineAvailable: lambda exc: Unavailable(
        f"No engine could serve this request: {exc}",
        code="no_engine_available",
        headers=RETRY_AFTER,
    ),
    EngineRejected: lambda exc: BadRequest(  # the request's fault: no other engine would take it
        f"The engine refused the request: {exc}", code="engine_rejected"
    ),
    EngineError: lambda exc: Unavailable(
        f"The engine serving this request failed: {exc}",
        code="engine_unavailable",
        headers=RETRY_AFTER,
    ),
}


def api_error(exc: Exception) -> ProxyError:
    """``exc`` in the API's terms: a ProxyError as it is, an engine failure as
    ``ENGINE_FAILURES`` says, anything else a ``server_error`` (logged with its traceback; the
    client learns nothing of the internals)."""
    if isinstance(exc, ProxyError):
        return exc
    for kind in type(exc).__mro__:
        if kind in ENGINE_FAILURES:
            return ENGINE_FAILURES[kind](exc)
    log.error("unexpected error while answering", exc_info=exc)
    return ProxyError("The server hit an internal error; it has been logged.")


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


_DONE = object()


async def drain(work: asyncio.Task, queue: asyncio.Queue) -> AsyncIterator[list[Any]]:
    """What ``work`` puts on ``queue``, in batches of whatever is already waiting (one write
    each), until ``work`` is done."""
    work.add_done_callback(lambda _: queue.put_nowait(_DONE))
    while True:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        done = batch[-1] is _DONE
        items = [item for item in batch if item is not _DONE]
        if items:
            yield items
        if done:
            return


async def first_output(work: asyncio.Task, produced: asyncio.Event) -> None:
    """Wait until ``work`` has produced something (``produced`` is set) or ended. If it failed
    before producing anything, raise its error now, while the response can still carry a status
    code (an engine's refusal becomes a 4xx rather than HTTP 200 and an error event)."""
    waiting = asyncio.create_task(produced.wait())
    try:
        await asyncio.wait({work, waiting}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        waiting.cancel()
    if work.done() and not produced.is_set():
        work.result()


class GuardedStream:
    """An answer's events (``guarded``) and the work that produces them, which ``stop`` cancels.

    The response calls ``stop`` however it ends: a client that leaves before the first chunk
    is written leaves the events' generator unstarted, and an unstarted generator never runs
    its ``finally``."""

    def __init__(self, events: AsyncIterator[str], work: asyncio.Task) -> None:
        self.work = work
        self.events = guarded(events, work)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    def stop(self) -> None:
        if not self.work.done():
            self.work.cancel()


async def guarded(events: AsyncIterator[str], work: asyncio.Task) -> AsyncIterator[str]:
    """``events`` then ``[DONE]``; an error mid-stream (the status is already 200) is reported
    in-band as OpenAI does, in the shape the same error has before a stream starts. Leaving
    early (the client went away) cancels ``work``."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = api_error(exc)
        yield sse(error_body(error.message, error.type, error.param, error.code))
    finally:
        if not work.done():
            work.cancel()
    yield sse("[DONE]")
