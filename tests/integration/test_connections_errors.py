"""A connection outlives an error response: after an unhandled error's 500 (a bug, a fault no
handler knew), a pooled client's next request goes out on the same connection and is answered.

Before, Starlette answered the 500 and raised the error again, uvicorn logged it a second time
and closed the connection, and a client that reused it at that moment lost its request in
transit. Served here by uvicorn with ``proxrl serve``'s protocol, on 127.0.0.1, the app holding
the proxy's error handling (``errors.install``) and two routes of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from server import errors, overload
from server.common.processes import free_port

pytestmark = pytest.mark.timeout(60)


def app_with_a_bug() -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/v1/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/v1/fine")
    async def fine() -> dict[str, str]:
        return {"status": "ok"}

    return app


@pytest.fixture
def server() -> Iterator[str]:
    port = free_port()
    limits = overload.ConnectionLimits(cap=64, header_timeout_s=5, body_timeout_s=5)
    config = uvicorn.Config(
        app_with_a_bug(), host="127.0.0.1", port=port, log_level="warning",
        http=overload.guarded_protocol(limits), timeout_keep_alive=120,
    )  # fmt: skip
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not running.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        running.should_exit = True
        thread.join(20)


def client_address(reply: httpx.Response) -> tuple[str, int]:
    return reply.extensions["network_stream"].get_extra_info("client_addr")


def test_the_next_pooled_request_after_a_500_uses_the_same_connection(server, caplog):
    caplog.set_level(logging.ERROR)
    with httpx.Client(base_url=server, timeout=10) as client:
        first = client.get("/v1/fine")
        bug = client.get("/v1/bug")
        after = client.get("/v1/fine")
        connections = {client_address(reply) for reply in (first, bug, after)}
    assert bug.status_code == 500
    assert bug.json()["error"]["message"] == errors.INTERNAL_MESSAGE
    assert "connection" not in bug.headers  # no "close"
    assert after.status_code == 200
    assert len(connections) == 1, connections
    logged = [record for record in caplog.records if record.exc_info]
    assert len(logged) == 1, [record.getMessage() for record in logged]  # once, not twice
