"""Server-sent events for the OpenAI-style streams: framing, pumping sampled pieces out in
batches under a latency bound (``drain``), the response that writes them (``SSEResponse``: the
stream's ``Final`` text in the same write as the body's end), and what a failure means for the
client (``api_error``: the same error before a stream starts, as a status code, and in it, as an
error event). It knows nothing of a surface's events or of what the pieces are."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


SSE = "text/event-stream"
_DONE = object()


class Inbox:
    """What a stream's work hands over (``put``: no await, once per engine chunk) for ``drain``
    to take in batches. A list and, while ``drain`` waits, one future: an ``asyncio.Queue``
    made a handful of Python calls per item on each side."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something is in it."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def take(self) -> list[Any]:
        items, self.items = self.items, []
        return items


async def drain(
    work: asyncio.Task, inbox: Inbox, bound_s: float = 0.0
) -> AsyncIterator[tuple[list[Any], float]]:
    """What ``work`` puts in ``inbox``, in batches (one write each), until ``work`` is done; each
    batch with its deadline, the loop time by which it must be out. The first batch is what is
    waiting when the first item comes, due at once; each later one what comes within ``bound_s``
    of its first item being taken up (less if ``work`` ends sooner), due ``bound_s`` after that:
    no item waits longer than that to go out, and a stream of many small items makes few
    writes. ``bound_s`` 0: every batch is what is waiting, at once."""
    loop = asyncio.get_running_loop()
    work.add_done_callback(lambda _: inbox.put(_DONE))
    first = True
    while True:
        await inbox.wait()
        hold = 0.0 if first else bound_s
        deadline = loop.time() + hold
        if hold > 0 and inbox.items[0] is not _DONE and not work.done():
            await asyncio.wait({work}, timeout=hold)
        first = False
        batch = inbox.take()
        done = batch[-1] is _DONE
        items = batch[:-1] if done else batch
        if items:
            yield items, deadline
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


class Final(str):
    """A stream's last text (its end, or an error event, and the closing): ``SSEResponse`` sends
    it with the end of the response body, in one write."""


class GuardedStream:
    """An answer's events (``guarded``) and the work that produces them, which ``stop`` cancels;
    ``on_error`` frames an error in the surface's shape, ``closing`` is its last text (the
    events end with it, in a ``Final``; after an error it follows the error's text).

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
        yield Final(on_error(api_error(exc)) + closing)
    finally:
        if not work.done():
            work.cancel()


class SSEResponse(StreamingResponse):
    """An SSE answer whose work stops however the response ends (see ``GuardedStream``). Its
    ``Final`` text goes out with the end of the body, in one write (Starlette's own response
    sends the end after the last text, empty: a write more per stream). A client that hangs up
    stops the stream at once, as in Starlette's response, with two asyncio tasks instead of an
    anyio task group (a third of its cost per stream)."""

    media_type = SSE

    def __init__(self, events: GuardedStream, headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers)
        self.events = events

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        ended = False
        async for text in self.body_iterator:
            ended = isinstance(text, Final)
            body = text.encode() if isinstance(text, str) else bytes(text)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            streaming.cancel()  # the client left (or this request was cancelled)
            self.events.stop()
            await asyncio.wait({streaming, listening})  # their cleanup is done here
        if not streaming.cancelled():
            streaming.result()  # the stream's own failure, if it had one
