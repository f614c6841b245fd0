"""Server-sent events for the OpenAI-style streams: framing, and pumping sampled pieces out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def drain(work: asyncio.Task, queue: asyncio.Queue) -> AsyncIterator[Any]:
    """Items ``work`` puts on ``queue``, as they come, until it is done and nothing is left."""
    while not (work.done() and queue.empty()):
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, work}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield getter.result()
        else:
            getter.cancel()


async def guarded(events: AsyncIterator[str], work: asyncio.Task) -> AsyncIterator[str]:
    """``events`` then ``[DONE]``; an error mid-stream (the status is already 200) is reported
    in-band as OpenAI does. Leaving early (the client went away) cancels ``work``."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        message = getattr(exc, "message", None) or "The server hit an error mid-stream."
        yield sse({"error": {"message": message, "type": type(exc).__name__, "code": None}})
    finally:
        if not work.done():
            work.cancel()
    yield sse("[DONE]")
