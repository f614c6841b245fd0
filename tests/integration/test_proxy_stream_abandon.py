"""A streamed request whose client leaves before the first token stops sampling.

A stream's headers go out with its first token (so that an engine's refusal can still be a
4xx). A client that leaves before then must not leave its request generating on the engine:
the engine is paused so that the request waits there, the client sends it over a raw socket
and hangs up, the engine continues, and the proxy must let go of the request at once rather
than sample it to the end. Measured: it lets go 0.13-0.22 s after the engine continues; the
same request answered to its end takes 2.3 s (428 tokens, then EOS). The proxy stops sampling
whether or not the response body ever started (``GuardedStream.stop``); with this uvicorn
the body does start, so this test also passed before that stop was added.
"""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.support import EngineProcess, ProxyProcess


def in_flight(proxy: ProxyProcess) -> int:
    rows = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin, timeout=10).json()
    return sum(row["in_flight"] for row in rows)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_stream_left_before_its_first_token_stops_sampling(tiny_model_dir, tmp_path):
    with (
        EngineProcess(tiny_model_dir, tmp_path, "--num-threads", "1") as engine,
        ProxyProcess(
            tiny_model_dir,
            tmp_path / "proxy",
            "--engines",
            engine.url,
            "--health-interval-s",
            "0.5",
        ) as proxy,
    ):
        session = proxy.session()
        url = httpx.URL(session["base_url"])
        body = json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Count for a long time."}],
                "max_tokens": 1500,
                "temperature": 1.0,
                "stream": True,
            }
        ).encode()
        request = (
            f"POST {url.path.rstrip('/')}/chat/completions HTTP/1.1\r\n"
            f"Host: {url.host}:{url.port}\r\nAuthorization: Bearer {session['api_key']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        pause = httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}, timeout=10)
        assert pause.status_code == 200, pause.text
        try:
            with socket.create_connection((url.host, url.port), timeout=10) as client:
                client.sendall(request)
                assert wait_for(lambda: in_flight(proxy) == 1, 10), "the request never arrived"
            # The client is gone; the request waits on the paused engine.
        finally:
            resumed = httpx.post(f"{engine.url}/continue_generation", json={}, timeout=10)
            assert resumed.status_code == 200, resumed.text
        # With its first token the proxy finds nobody to answer and stops sampling (the whole
        # answer would take ~2.3 s).
        assert wait_for(lambda: in_flight(proxy) == 0, 1.0), "still sampling for a gone client"

        def engine_running() -> int:
            loads = httpx.get(f"{engine.url}/v1/loads", timeout=10).json()["loads"]
            return sum(load["num_running_reqs"] for load in loads)

        assert wait_for(lambda: engine_running() == 0, 1.0), "the engine is still generating"
