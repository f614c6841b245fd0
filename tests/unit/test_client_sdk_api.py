"""client_sdk's public surface, its import hygiene, its error tree and its retries.

Retries are tested against a real HTTP server on 127.0.0.1 (``TinyServer``: a thread running
``http.server``) that answers from a script and records when each request arrived.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import client_sdk
from client_sdk import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    ProxrlError,
    RateLimitError,
    UnprocessableEntityError,
)
from client_sdk._base import backoff_delay, retry_delay
from client_sdk._errors import error_from_response
from tests.support import ROOT, free_port

PUBLIC_API = {
    "Client", "AsyncClient", "Session", "AsyncSession",
    "DEFAULT_TIMEOUT", "DEFAULT_MAX_RETRIES",
    "ProxrlError", "APIConnectionError", "APITimeoutError", "APIStatusError",
    "BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
    "ConflictError", "UnprocessableEntityError", "RateLimitError", "InternalServerError",
    "Run", "RunCreated", "RunMetrics", "SessionCreated", "SessionDetail", "Turn", "Row",
    "RewardResult", "SessionEnded", "EvalFigures", "RunEval", "RunTraining", "Promotion",
    "PromotionCandidate",
}  # fmt: skip
KEY = "sk-admin"
RUN = {"id": "run-1", "name": "r", "policy_version": 3, "sessions": {"open": 1}, "totals": {}}
CREATED = {
    "session_id": "sess-1",
    "run_id": "run-1",
    "api_key": "proxrl-sess-key",
    "base_url": "http://127.0.0.1:1/v1",
    "status": "open",
}


# --------------------------------------------------------------------------------------------
# a real HTTP server that answers from a script


@dataclass
class Reply:
    status: int = 200
    body: Any = field(default_factory=lambda: RUN)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


def error(status: int, code: str | None = None, message: str = "nope") -> Reply:
    body = {"error": {"message": message, "type": "some_error", "param": None, "code": code}}
    return Reply(status, body)


@dataclass
class Seen:
    at: float
    method: str
    path: str
    headers: dict[str, str]
    body: Any


class TinyServer:
    """``http.server`` on 127.0.0.1 in a thread. ``answer(method, path)`` picks each reply;
    ``TinyServer.scripted(*replies)`` answers them in order, repeating the last."""

    def __init__(self, answer: Callable[[str, str], Reply]) -> None:
        self.seen: list[Seen] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                server.seen.append(
                    Seen(
                        time.monotonic(),
                        self.command,
                        self.path,
                        dict(self.headers),
                        json.loads(raw) if raw else None,
                    )
                )
                reply = answer(self.command, self.path)
                time.sleep(reply.delay_s)
                payload = (
                    reply.body.encode()
                    if isinstance(reply.body, str)
                    else json.dumps(reply.body).encode()
                )
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            do_GET = do_POST = do_PATCH = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *args: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    @classmethod
    def scripted(cls, *replies: Reply) -> TinyServer:
        queue = list(replies)
        return cls(lambda method, path: queue.pop(0) if len(queue) > 1 else queue[0])

    def gaps(self) -> list[float]:
        """Seconds between consecutive requests."""
        return [b.at - a.at for a, b in zip(self.seen, self.seen[1:], strict=False)]

    def __enter__(self) -> TinyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def sessions_api(end_status: int = 200) -> Callable[[str, str], Reply]:
    """Creating a session answers CREATED; ending it answers ``end_status``."""

    def answer(method: str, path: str) -> Reply:
        if path == "/rl/sessions":
            return Reply(201, CREATED)
        if path.endswith("/end"):
            body = {"session_id": "sess-1", "status": "ended"}
            return Reply(200, body) if end_status == 200 else error(end_status)
        return error(404)

    return answer


# --------------------------------------------------------------------------------------------
# the public surface


def test_all_is_exactly_the_public_api():
    assert len(client_sdk.__all__) == len(set(client_sdk.__all__))
    assert set(client_sdk.__all__) == PUBLIC_API
    for name in client_sdk.__all__:
        assert getattr(client_sdk, name) is not None


def test_importing_client_sdk_imports_nothing_of_ours_nor_torch_or_ray():
    """client_sdk stands alone: no server/ or trainer/ code, no torch or ray; openai only when
    a session's OpenAI client is asked for."""
    code = "import json, sys, client_sdk; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    roots = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert "httpx" in roots
    assert not roots & {"server", "trainer", "torch", "ray", "openai"}


def test_the_package_is_typed():
    assert (Path(client_sdk.__file__).parent / "py.typed").is_file()


def test_configuration_comes_from_arguments_then_the_environment(monkeypatch):
    monkeypatch.delenv("PROXRL_BASE_URL", raising=False)
    monkeypatch.delenv("PROXRL_ADMIN_KEY", raising=False)
    with pytest.raises(ProxrlError, match="PROXRL_ADMIN_KEY"):
        Client()
    with pytest.raises(ValueError, match="max_retries"):
        Client(admin_key=KEY, max_retries=-1)
    with Client(admin_key=KEY, timeout=7) as client:
        assert client.base_url == "http://127.0.0.1:8000"
        assert client.timeout == httpx.Timeout(7)

    with TinyServer.scripted(Reply()) as server:
        monkeypatch.setenv("PROXRL_BASE_URL", server.url + "/")
        monkeypatch.setenv("PROXRL_ADMIN_KEY", "from-env")
        with Client() as client:
            client.get_run("run-1")
        with Client(admin_key="from-arg") as client:
            client.get_run("run-1")
    assert [seen.headers["Authorization"] for seen in server.seen] == [
        "Bearer from-env",
        "Bearer from-arg",
    ]


def test_requests_carry_the_paths_and_bodies_of_the_rest_api():
    with TinyServer.scripted(Reply()) as server, Client(server.url, KEY) as client:
        client.create_run(name="r", config={"batch_size": 2})
        client.list_runs(limit=5)
        client.update_run_config("run-1", {"max_staleness": 0})
        metrics = client.run_metrics("run-1")
        client.reward("sess/1", 0.5, completion_id="chatcmpl-x")
        client.end_session("sess-1")
    assert [(s.method, s.path, s.body) for s in server.seen] == [
        ("POST", "/rl/runs", {"name": "r", "config": {"batch_size": 2}}),
        ("GET", "/rl/runs?limit=5&offset=0", None),
        ("PATCH", "/rl/runs/run-1", {"config": {"max_staleness": 0}}),
        ("GET", "/rl/runs/run-1", None),
        ("POST", "/rl/sessions/sess%2F1/reward", {"reward": 0.5, "completion_id": "chatcmpl-x"}),
        ("POST", "/rl/sessions/sess-1/end", None),
    ]
    assert metrics == {
        "run_id": "run-1",
        "policy_version": 3,
        "sessions": {"open": 1},
        "totals": {},
    }


# --------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (403, PermissionDeniedError),
        (404, NotFoundError),
        (409, ConflictError),
        (422, UnprocessableEntityError),
        (429, RateLimitError),
        (500, InternalServerError),
        (502, InternalServerError),
        (503, InternalServerError),
        (418, APIStatusError),
    ],
)
def test_each_status_maps_to_its_error(status, expected):
    body = {"error": {"message": "what to fix", "type": "t", "param": "p", "code": "c"}}
    response = httpx.Response(status, json=body, headers={"Retry-After": "3"})
    err = error_from_response(response)
    assert type(err) is expected
    assert isinstance(err, APIStatusError) and isinstance(err, ProxrlError)
    assert (err.status_code, err.message, err.type, err.code, err.param) == (
        status,
        "what to fix",
        "t",
        "c",
        "p",
    )
    assert err.response is response and err.body == body
    assert "what to fix" in str(err) and str(status) in str(err)
    if expected is RateLimitError:
        assert err.retry_after == 3.0


def test_an_error_of_another_shape_keeps_its_text():
    err = error_from_response(httpx.Response(502, text="Bad Gateway from nginx"))
    assert isinstance(err, InternalServerError)
    assert err.message == "Bad Gateway from nginx" and err.type is None and err.code is None
    missing_route = error_from_response(httpx.Response(404, json={"detail": "Not Found"}))
    assert isinstance(missing_route, NotFoundError) and missing_route.message == "Not Found"


def test_errors_from_a_real_server_carry_the_openai_shaped_fields():
    with (
        TinyServer.scripted(error(409, "reward_conflict", "a different reward")) as server,
        Client(server.url, KEY) as client,
        pytest.raises(ConflictError) as raised,
    ):
        client.reward("sess-1", 1.0)
    assert raised.value.code == "reward_conflict"
    assert raised.value.message == "a different reward"
    assert raised.value.response.status_code == 409
    assert len(server.seen) == 1  # a 4xx other than 408/429 is not retried


# --------------------------------------------------------------------------------------------
# retries


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    for retries_taken in range(8):
        ceiling = min(0.5 * 2**retries_taken, 8.0)
        delays = [backoff_delay(retries_taken) for _ in range(200)]
        assert all(0.75 * ceiling <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # jittered


def test_retry_delay_honours_retry_after_and_the_retry_budget():
    refused = error_from_response(httpx.Response(429, headers={"Retry-After": "2"}))
    for _ in range(100):
        delay = retry_delay(0, 2, refused)
        assert delay is not None and 2.0 <= delay <= 2.2
    assert retry_delay(2, 2, refused) is None  # budget spent
    unavailable = error_from_response(httpx.Response(503, headers={"Retry-After": "1"}))
    delay = retry_delay(0, 1, unavailable)
    assert delay is not None and 1.0 <= delay <= 1.1
    too_long = error_from_response(httpx.Response(429, headers={"Retry-After": "120"}))
    assert retry_delay(0, 5, too_long) is None
    assert retry_delay(0, 5, error_from_response(httpx.Response(400))) is None
    assert retry_delay(0, 5, APIConnectionError()) is not None


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each client chose to wait, in order; the waits still really happen.

    The chosen wait is checked exactly; the gap between two arrivals at the server only from
    below (the client really waited), since a loaded machine can only make it longer.
    """
    chosen: list[float] = []

    def sleep(seconds: float) -> None:
        chosen.append(seconds)
        time.sleep(seconds)

    async def async_sleep(seconds: float) -> None:
        chosen.append(seconds)
        await asyncio.sleep(seconds)

    monkeypatch.setattr(client_sdk._client, "time", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(
        client_sdk._async_client, "asyncio", SimpleNamespace(sleep=async_sleep, Lock=asyncio.Lock)
    )
    return chosen


def test_a_429_is_retried_after_its_retry_after(waits: list[float]):
    refused = error(429, "staleness_bound")
    refused.headers["Retry-After"] = "1"
    with TinyServer.scripted(refused, Reply()) as server, Client(server.url, KEY) as client:
        assert client.get_run("run-1")["id"] == "run-1"
    assert len(server.seen) == 2
    (wait,) = waits
    (gap,) = server.gaps()
    assert 1.0 <= wait <= 1.1 and gap >= wait


def test_a_503_is_retried_with_backoff(waits: list[float]):
    with (
        TinyServer.scripted(error(503), error(503), Reply()) as server,
        Client(server.url, KEY, max_retries=2) as client,
    ):
        assert client.get_run("run-1")["id"] == "run-1"
    first, second = waits
    assert 0.375 <= first <= 0.5 and 0.75 <= second <= 1.0
    assert all(gap >= wait for gap, wait in zip(server.gaps(), waits, strict=True))


def test_retries_end_with_the_last_error():
    refused = error(429, "staleness_bound")
    refused.headers["Retry-After"] = "0"
    with (
        TinyServer.scripted(refused) as server,
        Client(server.url, KEY, max_retries=2) as client,
        pytest.raises(RateLimitError) as raised,
    ):
        client.session()
    assert len(server.seen) == 3
    assert raised.value.retry_after == 0.0 and raised.value.code == "staleness_bound"

    with (
        TinyServer.scripted(error(500)) as server,
        Client(server.url, KEY, max_retries=0) as client,
        pytest.raises(InternalServerError),
    ):
        client.get_run("run-1")
    assert len(server.seen) == 1


def test_no_answer_is_a_connection_error_and_a_slow_one_a_timeout():
    with (
        Client(f"http://127.0.0.1:{free_port()}", KEY, max_retries=0) as client,
        pytest.raises(APIConnectionError) as refused,
    ):
        client.list_runs()
    assert not isinstance(refused.value, APITimeoutError)
    assert isinstance(refused.value.__cause__, httpx.ConnectError)

    with (
        TinyServer.scripted(Reply(delay_s=1.0)) as server,
        Client(server.url, KEY, timeout=0.2, max_retries=1) as client,
        pytest.raises(APITimeoutError),
    ):
        client.list_runs()
    assert len(server.seen) == 2  # a timeout is retried too


def test_the_async_client_retries_the_same_way(waits: list[float]):
    refused = error(429, "staleness_bound")
    refused.headers["Retry-After"] = "0.3"  # fractional seconds are honoured too

    async def main(url: str) -> None:
        async with AsyncClient(url, KEY) as client:
            assert (await client.get_run("run-1"))["id"] == "run-1"
            assert (await client.run_metrics("run-1"))["policy_version"] == 3

    with TinyServer.scripted(refused, error(503), Reply()) as server:
        asyncio.run(main(server.url))
    assert len(server.seen) == 4
    retry_after_wait, backoff_wait = waits
    assert 0.3 <= retry_after_wait <= 0.33 and 0.75 <= backoff_wait <= 1.0  # its second retry
    assert all(gap >= wait for gap, wait in zip(server.gaps(), waits, strict=False))


# --------------------------------------------------------------------------------------------
# sessions


def test_a_session_ends_on_exit_even_when_the_block_raises():
    with TinyServer(sessions_api()) as server, Client(server.url, KEY) as client:
        with pytest.raises(ValueError, match="agent failed"), client.session(task_id="t") as s:
            assert (s.id, s.api_key, s.run_id) == ("sess-1", "proxrl-sess-key", "run-1")
            assert "proxrl-sess-key" not in repr(s)
            raise ValueError("agent failed")
        assert s.end()["status"] == "ended"  # ending again is fine
    assert [(seen.method, seen.path, seen.body) for seen in server.seen] == [
        ("POST", "/rl/sessions", {"task_id": "t"}),
        ("POST", "/rl/sessions/sess-1/end", None),
        ("POST", "/rl/sessions/sess-1/end", None),
    ]


def test_a_session_says_eval_or_production_only_when_asked():
    async def main(url: str) -> None:
        async with AsyncClient(url, KEY) as client, client.session(production=True):
            pass

    with TinyServer(sessions_api()) as server, Client(server.url, KEY) as client:
        client.session(eval=True)
        client.session(run_id="run-1", production=True)
        asyncio.run(main(server.url))
    created = [seen.body for seen in server.seen if seen.path == "/rl/sessions"]
    assert created == [
        {"eval": True},
        {"run_id": "run-1", "production": True},
        {"production": True},
    ]


def test_a_failed_end_does_not_hide_the_blocks_own_error():
    with (
        TinyServer(sessions_api(end_status=500)) as server,
        Client(server.url, KEY, max_retries=0) as client,
    ):
        with pytest.raises(ValueError, match="agent failed"), client.session():
            raise ValueError("agent failed")
        with pytest.raises(InternalServerError), client.session():
            pass


def test_the_async_session_is_created_when_entered_and_ended_on_exit():
    async def main(url: str) -> None:
        async with AsyncClient(url, KEY) as client:
            pending = client.session(group_id="g")
            with pytest.raises(ProxrlError, match="not created"):
                _ = pending.id
            with pytest.raises(RuntimeError, match="agent failed"):
                async with pending as session:
                    assert session.id == "sess-1"
                    raise RuntimeError("agent failed")
            awaited = await client.session()
            assert awaited.api_key == "proxrl-sess-key"

    with TinyServer(sessions_api()) as server:
        asyncio.run(main(server.url))
    assert [(seen.method, seen.path) for seen in server.seen] == [
        ("POST", "/rl/sessions"),
        ("POST", "/rl/sessions/sess-1/end"),
        ("POST", "/rl/sessions"),
    ]
    assert server.seen[0].body == {"group_id": "g"}


def test_session_openai_clients_point_at_the_session():
    import openai

    with TinyServer(sessions_api()) as server, Client(server.url, KEY) as client:
        session = client.session()
        with session.openai(max_retries=0) as sync_openai:
            assert isinstance(sync_openai, openai.OpenAI)
            assert str(sync_openai.base_url).rstrip("/") == CREATED["base_url"]
            assert sync_openai.api_key == CREATED["api_key"]
            assert sync_openai.max_retries == 0
        async_openai = session.async_openai()
        assert isinstance(async_openai, openai.AsyncOpenAI)
        assert async_openai.api_key == CREATED["api_key"]
        asyncio.run(async_openai.close())
