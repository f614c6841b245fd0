"""What one client can hold of a real ``proxrl serve``, and the fast 503 past it.

- 600 idle connections (300 that made a request and stay kept alive, 300 that never send a
  byte) against a proxy whose open-file limit is 300: new requests are still answered at once
  (the idle ones longest idle are closed to make room), and the log says so once. Before, the
  proxy ran out of descriptors, stopped accepting, and new requests hung.
- Past the session class's bound of requests in flight, a request is answered 503 with
  Retry-After at once, in the shape of its API (OpenAI's, Anthropic's); other classes are still
  served, and the class is served again once its requests end.
- A client that sends its headers or its body a byte at a time, or nothing at all, is cut off
  after the header or body timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.support import ProxyProcess

pytestmark = pytest.mark.timeout(240)

DESCRIPTORS = 300
IDLE_CONNECTIONS = 600
TIMEOUT_S = 2.0  # the header and body timeouts of the second proxy
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@contextlib.contextmanager
def open_file_limit(soft: int) -> Iterator[None]:
    """Children started inside inherit ``soft`` as their open-file limit."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


class LimitedProxy(ProxyProcess):
    def __init__(self, model_dir: Path, data_dir: Path, *extra: str) -> None:
        with open_file_limit(DESCRIPTORS):
            super().__init__(model_dir, data_dir, *extra)


def host_port(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


async def idle_connections(url: str, count: int) -> list[asyncio.StreamWriter]:
    """``count`` connections: each second one made a request (kept alive), the rest silent."""
    host, port = host_port(url)
    writers, answers = [], []
    for index in range(count):
        reader, writer = await asyncio.open_connection(host, port)
        writers.append(writer)
        if index % 2 == 0:
            writer.write(b"GET / HTTP/1.1\r\nhost: proxy\r\n\r\n")
            answers.append(answered(reader))
    await asyncio.gather(*answers)
    return writers


async def answered(reader: asyncio.StreamReader) -> None:
    """Its answer read, if one comes within 5 s (a closed connection is idle too)."""
    with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        await asyncio.wait_for(reader.readuntil(b'"ok"}'), 5)


def test_idle_connections_do_not_shut_out_new_requests(tiny_model_dir, tmp_path):
    with LimitedProxy(tiny_model_dir, tmp_path) as proxy:
        log = proxy.log_path.read_text()
        assert "connections: at most" in log  # the cap fits the limit, and says so

        async def scenario() -> list[float]:
            writers = await idle_connections(proxy.url, IDLE_CONNECTIONS)
            latencies = []
            try:
                async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as fresh:
                    for _ in range(20):
                        started = time.perf_counter()
                        reply = await fresh.get("/v1/models", headers=proxy.admin)
                        assert reply.status_code == 200, reply.text
                        latencies.append(time.perf_counter() - started)
            finally:
                for writer in writers:
                    writer.close()
            return latencies

        latencies = asyncio.run(scenario())
        print(
            f"20 new requests past {IDLE_CONNECTIONS} idle connections: max {max(latencies):.3f} s"
        )
        assert max(latencies) < 2.0
        assert "at the connection cap" in proxy.log_path.read_text()


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    extra = (
        "--max-requests-session", "3", "--max-requests-per-session", "2",
        "--header-timeout-s", str(TIMEOUT_S), "--body-timeout-s", str(TIMEOUT_S),
    )  # fmt: skip
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("guarded"), *extra) as proxy:
        yield proxy


def held_request(url: str, path: str, key: str) -> socket.socket:
    """A request whose headers arrived and whose body never does: in flight until the body
    timeout."""
    held = socket.create_connection(host_port(url))
    head = (
        f"POST {path} HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer {key}\r\n"
        "content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
    )
    held.sendall(head.encode())
    return held


def test_past_the_session_bound_a_fast_503_in_each_surface_shape(guarded):
    session, other = guarded.session(), guarded.session()
    key, path = session["api_key"], "/v1/chat/completions"
    held = [held_request(guarded.url, path, key) for _ in range(2)]
    held.append(held_request(guarded.url, path, other["api_key"]))
    try:
        time.sleep(0.3)  # all three are in flight: the class's bound
        key = guarded.session()["api_key"]  # a third session, with nothing in flight
        chat = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=key, max_retries=0)
        started = time.perf_counter()
        with pytest.raises(openai.InternalServerError) as refused:
            chat.chat.completions.create(**CHAT)
        assert time.perf_counter() - started < 1.0
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "overloaded"  # type: ignore[index]
        claude = anthropic.Anthropic(base_url=guarded.url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as shaped:
            claude.messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
            )
        assert shaped.value.status_code == 503
        assert shaped.value.body["type"] == "error"  # type: ignore[index]
        # Other classes are served meanwhile: the admin, and anonymous probes.
        assert httpx.get(f"{guarded.url}/rl/runs", headers=guarded.admin).status_code == 200
        assert httpx.get(f"{guarded.url}/health").status_code == 200
    finally:
        for connection in held:
            connection.close()
    time.sleep(0.3)
    answer = chat.chat.completions.create(**CHAT)
    assert answer.choices[0].message is not None


def test_one_session_cannot_take_its_class_bound(guarded):
    """Before, one agent holding 2,048 requests took every session's place; now a session has
    --max-requests-per-session (2 here) and the others are served."""
    busy, other = guarded.session(), guarded.session()
    path = "/v1/chat/completions"
    held = [held_request(guarded.url, path, busy["api_key"]) for _ in range(2)]
    try:
        time.sleep(0.3)
        chat = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=busy["api_key"], max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            chat.chat.completions.create(**CHAT)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert "requests of this session are in flight" in str(refused.value.body)
        # The path form counts the same session, by the id in its path.
        by_path = httpx.post(
            f"{guarded.url}/sessions/{busy['session_id']}/v1/chat/completions", json=CHAT
        )
        assert by_path.status_code == 503, by_path.text
        served = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=other["api_key"])
        assert served.chat.completions.create(**CHAT).choices[0].message is not None
    finally:
        for connection in held:
            connection.close()
    time.sleep(0.3)
    assert chat.chat.completions.create(**CHAT).choices[0].message is not None


def cut_after(connection: socket.socket, dribble: bytes) -> float:
    """Seconds until the server closes ``connection`` while it sends ``dribble`` a byte every
    0.2 s (then nothing)."""
    started = time.perf_counter()
    connection.settimeout(0.2)
    for byte in dribble:
        try:
            connection.sendall(bytes([byte]))
            if connection.recv(4096) == b"":
                return time.perf_counter() - started
        except TimeoutError:
            continue
        except OSError:
            return time.perf_counter() - started
    connection.settimeout(10)
    with contextlib.suppress(OSError):
        while connection.recv(4096):
            pass
    return time.perf_counter() - started


def test_slow_clients_are_cut_off(guarded):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-length: 500\r\n\r\n"
    cases = {
        "silent": b"",
        "header a byte at a time": head * 10,
        "body a byte at a time": head + b" " * 400,
    }
    for name, dribble in cases.items():
        with socket.create_connection(host_port(guarded.url)) as connection:
            if name == "body a byte at a time":
                connection.sendall(head)
                dribble = dribble[len(head) :]
            seconds = cut_after(connection, dribble)
        print(f"{name}: cut after {seconds:.1f} s")
        assert TIMEOUT_S - 0.5 < seconds < TIMEOUT_S + 2, name
