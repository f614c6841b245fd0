"""A bare forwarder: the cheapest Python hop in front of an engine, for bench/proxy.py.

``python bench/forwarder.py ENGINE_URL PORT`` serves ``POST /generate`` on 127.0.0.1:PORT by
sending the body to the engine's ``/generate`` with aiohttp and returning the engine's answer, a
stream passed on block by block as it arrives (and ``GET /health``, answered itself):
uvicorn (uvloop + httptools) and aiohttp, as in ``proxrl serve``, and nothing else (no
framework, no template, no tokenizer, no store). What it adds over calling the engine directly
is what any extra HTTP hop in Python costs on the machine; bench/proxy.py reports it beside the
proxy so the proxy's own share can be read off.
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn

TIMEOUT = aiohttp.ClientTimeout(total=120.0, connect=5.0)


async def _lifespan(http: list[aiohttp.ClientSession], receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            http.append(aiohttp.ClientSession(timeout=TIMEOUT))
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await http[0].close()
            await send({"type": "lifespan.shutdown.complete"})
            return


def create_app(engine_url: str):
    http: list[aiohttp.ClientSession] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(http, receive, send)
            return
        if scope["method"] == "GET":  # /health
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {"Content-Type": "application/json"}
        async with http[0].post(f"{engine_url}/generate", data=body, headers=headers) as reply:
            kind = reply.headers.get("Content-Type", "application/json")
            if kind.startswith("text/event-stream"):  # passed on block by block, as it comes
                start = [(b"content-type", kind.encode())]
                await send(
                    {"type": "http.response.start", "status": reply.status, "headers": start}
                )
                async for block in reply.content.iter_any():
                    await send({"type": "http.response.body", "body": block, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            answer, status = await reply.read(), reply.status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(answer)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    return app


if __name__ == "__main__":
    uvicorn.run(
        create_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning"
    )
