"""An engine that fails, times out or stops under a request: every surface answers in its own
error shape (OpenAI's ``{"error": {...}}`` on Chat Completions and Responses, Anthropic's
``{"type": "error", "error": {...}}`` on Messages), with a 503 and Retry-After where trying
again may help, never a plain-text 500; a prompt over the context is a 400 in the same shapes.

Each failure runs through the real embedded engine (scheduler, HTTP app) behind a real proxy
app of its own: a prefill that raises MemoryError (what a prompt too large for memory raises),
a prefill slower than the proxy's request timeout, an engine stopped while it prefills.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api.api_support import ADMIN_KEY, Api
from tests.api.conftest import ThreadedEngine

MODEL = "tiny"
SURFACES = ("chat", "messages", "responses")


def request(surface: str, text: str) -> tuple[str, dict]:
    if surface == "chat":
        messages = [{"role": "user", "content": text}]
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}
    if surface == "messages":
        messages = [{"role": "user", "content": text}]
        return "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": 2}
    return "/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": 2}


def send(api: Api, session: dict, surface: str, text: str) -> httpx.Response:
    path, body = request(surface, text)
    headers = {"anthropic-version": "2023-06-01"} if surface == "messages" else {}
    return api.call("POST", path, key=session["api_key"], json=body, headers=headers)


def error_of(reply: httpx.Response, surface: str, status: int) -> dict:
    """The error object of ``reply``, checked to be ``status`` in the surface's own shape."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.text
    body = reply.json()
    if surface == "messages":
        assert body["type"] == "error" and set(body) == {"type", "error"}, body
        error = body["error"]
        assert set(error) >= {"type", "message"}, error
    else:
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def long_text(tokens: int) -> str:
    """A user message of about ``tokens`` tokens (digits are one token each)."""
    return "7" * tokens


@contextmanager
def proxy_on(engine: ThreadedEngine, tmp_path, **settings) -> Iterator[Api]:
    from server.main import create_app
    from server.settings import ServerSettings

    config = ServerSettings(
        model=str(engine.service.settings.model),
        engines=engine.url,
        data_dir=tmp_path,
        admin_key=ADMIN_KEY,
        log_level="warning",
        **settings,
    )
    with TestClient(create_app(config)) as client:
        yield Api(client, Path(engine.service.settings.model))


@contextmanager
def engine_with(tiny_model_dir, prefill: Callable | None = None) -> Iterator[ThreadedEngine]:
    """A threaded engine of its own whose runner's prefill is ``prefill(original, *args)``."""
    engine = ThreadedEngine(tiny_model_dir)
    if prefill is not None:
        original = engine.service.runner.prefill
        engine.service.runner.prefill = (  # type: ignore[method-assign]
            lambda *args, **kwargs: prefill(original, *args, **kwargs)
        )
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.mark.parametrize("surface", SURFACES)
def test_a_prompt_over_the_context_is_a_400_in_the_surfaces_shape(api: Api, surface):
    session = api.new_session(task_id="too-long")
    reply = send(api, session, surface, long_text(3000))  # the tiny model's context: 2048
    error = error_of(reply, surface, 400)
    assert "context" in error["message"]
    if surface != "messages":
        assert error["code"] == "context_length_exceeded"
    assert api.session(session["session_id"])["turns"] == []


def test_a_prefill_that_runs_out_of_memory_is_a_503_on_every_surface(tiny_model_dir, tmp_path):
    attempts: list[int] = []

    def out_of_memory(original, slot, ids, *args, **kwargs):
        if len(ids) > 500:
            attempts.append(len(ids))
            raise MemoryError("cannot allocate the prefill")
        return original(slot, ids, *args, **kwargs)

    with engine_with(tiny_model_dir, out_of_memory) as engine, proxy_on(engine, tmp_path) as api:
        session = api.new_session(task_id="oom")
        for surface in SURFACES:
            before = len(attempts)
            reply = send(api, session, surface, long_text(800))
            error = error_of(reply, surface, 503)
            assert "prefill failed: MemoryError" in error["message"]
            assert int(reply.headers["retry-after"]) >= 1
            assert len(attempts) == before + 1  # not resubmitted: it would fail again
        # The engine stays in rotation and serves what fits.
        assert send(api, session, "chat", "hi").status_code == 200


def test_an_engine_slower_than_the_request_timeout_is_a_503_on_every_surface(
    tiny_model_dir, tmp_path
):
    slow_now = threading.Event()

    def slow(original, *args, **kwargs):
        if slow_now.is_set():
            time.sleep(2.5)
        return original(*args, **kwargs)

    with (
        engine_with(tiny_model_dir, slow) as engine,
        proxy_on(engine, tmp_path, request_timeout_s=1.0) as api,
    ):
        session = api.new_session(task_id="timeout")
        assert send(api, session, "chat", "hi").status_code == 200  # the engine is in rotation
        slow_now.set()
        for surface in SURFACES:
            reply = send(api, session, surface, "hi")
            error = error_of(reply, surface, 503)
            assert "did not finish within 1 s" in error["message"]
            assert int(reply.headers["retry-after"]) >= 1
            if surface != "messages":
                assert error["code"] == "engine_timeout"


@pytest.mark.parametrize("surface", SURFACES)
def test_an_engine_stopped_mid_prefill_is_a_503_in_the_surfaces_shape(
    surface, tiny_model_dir, tmp_path
):
    started = threading.Event()

    def slow_chunks(original, slot, ids, cancelled=None, **kwargs):
        def between_chunks() -> bool:
            started.set()
            time.sleep(0.05)
            return cancelled is not None and cancelled()

        return original(slot, ids, cancelled=between_chunks, **kwargs)

    with engine_with(tiny_model_dir, slow_chunks) as engine, proxy_on(engine, tmp_path) as api:
        runner = engine.service.runner
        runner.config = dataclasses.replace(runner.config, prefill_chunk=8)
        session = api.new_session(task_id="stopped")
        replies: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: replies.append(send(api, session, surface, long_text(1500)))
        )
        client.start()
        assert started.wait(timeout=30), "the prefill did not start"
        stopped_at = time.monotonic()
        engine.stop()
        client.join(timeout=60)
        assert not client.is_alive(), "the request did not end after its engine stopped"
        (reply,) = replies
        error = error_of(reply, surface, 503)
        assert int(reply.headers["retry-after"]) >= 1
        assert time.monotonic() - stopped_at < 30  # the prefill stopped between chunks
        if surface != "messages":
            assert error["code"] == "no_engine_available"
