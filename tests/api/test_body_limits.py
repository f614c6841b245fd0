"""A body over its route's limit is answered 413 before it is read whole, and a request without a
valid key 401 before its body is read at all: the app of ``create_app`` behind uvicorn on a
loopback socket, spoken to over a raw socket so that the test controls what has been sent when
the answer comes.

Before: no limit (a 49.7 MB body was read, parsed and rendered), and a key was checked only once
the whole body had been read and parsed: the server waited for bytes the client never sent, so
these tests timed out where they now get their answer at once."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.api.api_support import ADMIN_KEY, app_settings

REST_LIMIT = 1024 * 1024
MODEL_LIMIT = 2 * 1024 * 1024
ANSWER_TIMEOUT_S = 5.0
FORTY_MB = 40 * 1024 * 1024


class ServedProxy:
    """The proxy app served by uvicorn on a thread of this process, on a socket of its own."""

    def __init__(self, app) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> ServedProxy:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, engine, tmp_path_factory) -> Iterator[ServedProxy]:
    from server.main import create_app

    settings = app_settings(
        tiny_model_dir,
        engine.url,
        tmp_path_factory.mktemp("limits"),
        max_rest_body_bytes=REST_LIMIT,
        max_body_bytes=MODEL_LIMIT,
    )
    with ServedProxy(create_app(settings)) as served:
        yield served


@pytest.fixture(scope="module")
def session_key(proxy: ServedProxy) -> str:
    reply = httpx.post(
        f"{proxy.url}/rl/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert reply.status_code == 201, reply.text
    return reply.json()["api_key"]


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on ``connection`` (Content-Length framed)."""
    data = b""
    connection.settimeout(ANSWER_TIMEOUT_S)
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    length = next(int(v) for k, _, v in (x.partition(": ") for x in lines) if k == "content-length")
    while len(rest) < length:
        rest += connection.recv(65536)
    return int(lines[0].split()[1]), json.loads(rest[:length])


def sent_unanswered(proxy: ServedProxy, path: str, headers: dict[str, str], body: bytes = b""):
    """Send the head and only ``body`` of a request, and read the answer."""
    with socket.create_connection(("127.0.0.1", proxy.port)) as connection:
        connection.sendall(head(path, headers) + body)
        return answer(connection)


def test_a_declared_length_over_the_limit_is_answered_413_unread(proxy, session_key):
    cases = [  # path, key headers, limit
        ("/rl/sessions", {"Authorization": f"Bearer {ADMIN_KEY}"}, REST_LIMIT),
        ("/v1/chat/completions", {"Authorization": f"Bearer {session_key}"}, MODEL_LIMIT),
        ("/v1/messages", {"x-api-key": session_key}, MODEL_LIMIT),
    ]
    for path, keyed, limit in cases:
        headers = {**keyed, "Content-Length": str(limit + 1)}
        started = time.monotonic()
        status, body = sent_unanswered(proxy, path, headers, b'{"a": "')
        assert status == 413 and time.monotonic() - started < ANSWER_TIMEOUT_S
        if path == "/v1/messages":
            assert body["error"]["type"] == "request_too_large", body
        else:
            assert body["error"]["code"] == "request_too_large", body
            assert f"{limit:,}" in body["error"]["message"]


def test_a_chunked_body_is_counted_and_refused_once_past_the_limit(proxy):
    chunk = b"x" * 65536
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "Transfer-Encoding": "chunked"}
    with socket.create_connection(("127.0.0.1", proxy.port)) as connection:
        connection.sendall(head("/rl/sessions", headers) + b"1\r\n{\r\n")
        sent = 1
        while sent < 8 * REST_LIMIT:
            if select.select([connection], [], [], 0.02)[0]:
                break
            connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, body = answer(connection)
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert sent < 4 * REST_LIMIT  # answered soon after the limit, not at the body's end


@pytest.mark.parametrize("path", ["/rl/sessions", "/v1/chat/completions", "/v1/messages"])
def test_no_key_or_a_wrong_one_is_answered_401_before_a_40_mb_body(proxy, path):
    for keyed in ({}, {"Authorization": "Bearer not-a-key"}, {"x-api-key": "not-a-key"}):
        headers = {**keyed, "Content-Length": str(FORTY_MB)}
        started = time.monotonic()
        status, body = sent_unanswered(proxy, path, headers, b'{"model": "tiny", ')
        assert status == 401, body
        assert time.monotonic() - started < ANSWER_TIMEOUT_S
        assert body["error"]["type"] == "authentication_error"  # Anthropic's type too


def test_a_path_form_session_that_does_not_exist_is_404_before_its_body(proxy):
    headers = {"Content-Length": str(MODEL_LIMIT)}
    status, body = sent_unanswered(proxy, "/sessions/sess-none/v1/chat/completions", headers)
    assert status == 404 and body["error"]["code"] == "session_not_found", body


def test_an_http_client_sending_too_much_reads_the_413(proxy, session_key):
    """The whole body sent, as SDKs send it: the client gets the answer, not a broken pipe."""
    messages = [{"role": "user", "content": "x" * (MODEL_LIMIT + 10)}]
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2},
        headers={"Authorization": f"Bearer {session_key}"},
        timeout=30,
    )
    assert reply.status_code == 413, reply.text
    under = [{"role": "user", "content": "hello " * 1000}]
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "tiny", "messages": under, "max_tokens": 2},
        headers={"Authorization": f"Bearer {session_key}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
