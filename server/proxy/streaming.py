"""Server-sent events for the OpenAI-style streams: framing, pumping sampled pieces out, and
what a failure means for the client (``api_error``: the same error before a stream starts, as
a status code, and in it, as an error event)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.common import one_line_json
from server.errors import INTERNAL_MESSAGE, ProxrlError

log = logging.getLogger(__name__)


def api_error(exc: Exception) -> ProxrlError:
    """``exc`` in the API's terms: an error of ``server.errors``' tree as it is (engine failures
    included), anything else a ``server_error`` (logged with its traceback; the client learns
    nothing of the internals)."""
    if isinstance(exc, ProxrlError):
        return exc
    log.error("unexpected error while answering", exc_info=exc)
    return ProxrlError(INTERNAL_MESSAGE)


def sse(payload: dict | str, event: str | None = None) -> str:
    """One SSE event: ``data:`` (JSON, or a bare string like ``[DONE]``), named by an ``event:``
    line where the surface names its events. The JSON holds no raw line end of any kind."""
    data = payload if isinstance(payload, str) else one_line_json.dumps(payload)
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"


_DONE = object()


async def drain(
    work: asyncio.Task, queue: asyncio.Queue, linger_s: float = 0.0
) -> AsyncIterator[list[Any]]:
    """What ``work`` puts on ``queue``, in batches (one write each), until ``work`` is done. The
    first batch is what is waiting when the first item comes; each later one what comes within
    ``linger_s`` of its first item (less if ``work`` ends sooner): no item waits longer than
    that to go out, and a stream of many small items makes few writes."""
    work.add_done_callback(lambda _: queue.put_nowait(_DONE))
    first = True
    while True:
        batch = [await queue.get()]
        if not first and linger_s > 0 and batch[0] is not _DONE and not work.done():
            await asyncio.wait({work}, timeout=linger_s)
        first = False
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
    """An answer's events (``guarded``) and the work that produces them, which ``stop`` cancels;
    ``on_error`` frames an error in the surface's shape, ``closing`` is its last text (the
    events end with it; after an error it follows the error's text).

    The response calls ``stop`` however it ends: a client that leaves before the first chunk
    is written leaves the events' generator unstarted, and an unstarted generator never runs
    its ``finally``."""

    def __init__(
        self,
        events: AsyncIterator[str],
        work: asyncio.Task,
        on_error: Callable[[ProxrlError], str],
        closing: str,
    ) -> None:
        self.work = work
        self.events = guarded(events, work, on_error, closing)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    def stop(self) -> None:
        if not self.work.done():
            self.work.cancel()


async def guarded(
    events: AsyncIterator[str],
    work: asyncio.Task,
    on_error: Callable[[ProxrlError], str],
    closing: str,
) -> AsyncIterator[str]:
    """``events``, which end with ``closing`` (OpenAI's ``[DONE]``: in the same write as the
    last events); an error mid-stream (the status is already 200) is reported in-band
    (``on_error``), as the same error would be before a stream starts, and ``closing`` follows
    it. Leaving early (the client went away) cancels ``work``."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield on_error(api_error(exc)) + closing
    finally:
        if not work.done():
            work.cancel()
