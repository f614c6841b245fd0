"""A session that sends the same prompt again and again costs the same per request at its
1,000th request as at its first (issue 27 measured 5.6 ms per request for the first 100 and
45.8 ms by the 800th: every earlier attempt was kept and checked again on each request).

The proxy app in this process (as in tests/api; ~40 s here, so slow), on a stub engine
(bench/stub_engine.py: the SGLang protocol with made-up tokens, no model, in a thread of its
own) so that the engine's time does not blur the proxy's; one session, 1,000 identical chat
requests (each one a retry of the one before). What is counted is work, not time (on a shared
machine a request's CPU time varied by 60 % between batches of 100 with no trend): the Python
function calls the app's event loop thread makes for each request, and after each batch of 100
what the session keeps in memory (its turns, rows and conversations). The kept state must be the
same after every batch, and the median calls per request of the last 100 within 10 % of the
first 100's.
"""

from __future__ import annotations

import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from bench.stub_engine import Stub
from bench.stub_engine import create_app as create_stub_app
from tests.api.api_support import Api, app_settings

REQUESTS, BATCH = 1_000, 100
START_TIMEOUT_S = 30.0
BODY = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 17 + 25?"},
    ],
    "max_tokens": 32,
    "seed": 7,
}


class PythonCalls:
    """Python function calls (and coroutine resumptions) in the thread it profiles."""

    def __init__(self) -> None:
        self.count = 0

    def profile(self, frame: object, event: str, arg: object) -> None:
        if event == "call":
            self.count += 1


@pytest.fixture
def stub_url(tiny_model_dir: Path) -> Iterator[str]:
    """The stub engine on a loopback socket of its own, served by uvicorn in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_stub_app(Stub(tiny_model_dir, 16)), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub engine did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_same_prompt_costs_the_same_at_the_thousandth_request(
    tiny_model_dir: Path, stub_url: str, tmp_path: Path
):
    from server.main import create_app

    with TestClient(create_app(app_settings(tiny_model_dir, stub_url, tmp_path))) as client:
        api = Api(client, tiny_model_dir)
        ctx = client.app.state.ctx  # type: ignore[attr-defined]
        session = api.new_session()
        path = f"/sessions/{session['session_id']}/v1/chat/completions"
        calls = PythonCalls()
        counts, kept = [], []
        for index in range(REQUESTS):
            profiled = index < BATCH or index >= REQUESTS - BATCH  # the profiler is slow
            if profiled:
                client.portal.call(sys.setprofile, calls.profile)  # type: ignore[union-attr]
            before = calls.count
            api.ok("POST", path, key=session["api_key"], json=BODY)
            if profiled:
                client.portal.call(sys.setprofile, None)  # type: ignore[union-attr]
                counts.append(calls.count - before)
            if index % BATCH == BATCH - 1:
                state = client.portal.call(ctx.sessions.get, session["session_id"])  # type: ignore[union-attr]
                kept.append((len(state.last), len(state.row_tails), len(state.conversations)))
        stored = api.session(session["session_id"])

    first, last = statistics.median(counts[:BATCH]), statistics.median(counts[BATCH:])
    assert stored["turn_count"] == REQUESTS
    assert set(kept) == {kept[0]}, kept
    assert last <= 1.10 * first, (first, last)
