"""An engine answer of no token at all still makes a well-formed stream on every surface: the
start event (OpenAI's role chunk, Anthropic's ``message_start``, the Responses API's
``response.created``) goes out with the first deltas, and when no delta ever comes it goes out
with the end, or before the error event if the answer cannot be recorded.

The engine is the stub engine (bench/stub_engine.py: SGLang's protocol, no model, in a thread of
its own) with ``/generate`` answering a stream of one chunk: no output id, finish ``stop`` (what
an engine that ends an answer without a token sends); the proxy app runs in this process, and
each stream is read by the real SDK of its surface. The failing write is a real one: SQLite
locked by another connection past the store's busy timeout.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionChunk

from bench.stub_engine import Stub, read_body
from bench.stub_engine import create_app as create_stub_app
from server.store.database import sqlite_file
from tests.api.api_support import Api, app_settings, sse_events

START_TIMEOUT_S = 30.0
BUSY_TIMEOUT_S = 0.2
USER: list[Any] = [{"role": "user", "content": "hi"}]
SSE_HEADERS = [(b"content-type", b"text/event-stream")]


def no_token_engine(stub: Stub):
    """The stub engine, whose streamed ``/generate`` answers no token: one chunk with no output
    id and the finish ``stop``, then ``[DONE]``."""
    app = create_stub_app(stub)

    async def engine(scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            await app(scope, receive, send)
            return
        body = await read_body(receive)
        request = json.loads(body)
        assert request.get("stream"), "the tests stream"
        finish = {"type": "stop", "matched": stub.eos}
        chunk = stub.output(request["rid"], [], [], finish, len(request["input_ids"]), 0)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": data})

    return engine


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Api]:
    """The proxy app on the no-token engine, which uvicorn serves in a thread on 127.0.0.1."""
    from server.main import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = no_token_engine(Stub(tiny_model_dir, 16))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub engine did not start"
        time.sleep(0.01)
    settings = app_settings(
        tiny_model_dir,
        f"http://127.0.0.1:{sock.getsockname()[1]}",
        tmp_path_factory.mktemp("no-token"),
        store_busy_timeout_s=BUSY_TIMEOUT_S,
    )
    try:
        with TestClient(create_app(settings)) as client:
            yield Api(client, tiny_model_dir)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def locked(api: Api) -> Iterator[None]:
    """Another connection's write transaction on the store, held until the block ends."""
    path = sqlite_file(api.http.app.state.ctx.settings.database_url)  # type: ignore[attr-defined]
    assert path is not None
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def turns(api: Api, session: dict) -> list[dict]:
    return api.session(session["session_id"])["turns"]


def test_openai_chat_stream_of_no_token_starts_with_the_role(api: Api):
    session = api.new_session(task_id="no-token-chat")
    client = api.openai(session["api_key"])
    chunks: list[ChatCompletionChunk] = list(
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant", chunks
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"], chunks
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert len(turns(api, session)) == 1


def test_anthropic_stream_of_no_token_parses_in_the_sdk(api: Api):
    session = api.new_session(task_id="no-token-messages")
    client = api.anthropic(session["api_key"])
    with client.messages.stream(model="tiny", messages=USER, max_tokens=8) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 0, message
    assert len(turns(api, session)) == 1


def test_responses_stream_of_no_token_parses_in_the_sdk(api: Api):
    session = api.new_session(task_id="no-token-responses")
    client = api.openai(session["api_key"])
    with client.responses.stream(model="tiny", input="hi", max_output_tokens=8) as stream:
        events = list(stream)
        response = stream.get_final_response()
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert response.status == "completed" and response.output_text == "", response
    assert len(turns(api, session)) == 1


def test_a_store_error_after_no_token_follows_the_start_on_every_surface(api: Api):
    """The answer cannot be recorded (the store is locked): the stream is under way (HTTP 200),
    so the error is an event, and each SDK reads it as the error it is, after the start."""
    session = api.new_session(task_id="no-token-store-error")
    key = session["api_key"]
    with locked(api):
        body = {"model": "tiny", "messages": USER, "max_tokens": 8, "stream": True}
        chat = sse_events(api.call("POST", "/v1/chat/completions", key=key, json=body))
        chunks: list[ChatCompletionChunk] = []
        with pytest.raises(openai.APIError) as sdk_chat:
            for chunk in api.openai(key).chat.completions.create(
                model="tiny",
                messages=USER,
                max_tokens=8,
                stream=True,
            ):
                chunks.append(chunk)
        kinds = []  # the SDK raises at the error event, after the start
        with (
            pytest.raises(anthropic.APIStatusError) as messages,
            api.anthropic(key).messages.stream(
                model="tiny",
                messages=USER,
                max_tokens=8,
            ) as stream,
        ):
            for event in stream:
                kinds.append(event.type)
        with api.openai(key).responses.stream(
            model="tiny", input="hi", max_output_tokens=8
        ) as responses:
            events = list(responses)

    assert chat[0]["choices"][0]["delta"]["role"] == "assistant", chat  # type: ignore[index]
    assert chat[1]["error"]["code"] == "store_unavailable" and chat[2:] == ["[DONE]"], chat  # type: ignore[index]
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"], chunks
    assert sdk_chat.value.body["code"] == "store_unavailable"  # type: ignore[index]
    assert kinds and kinds[0] == "message_start", kinds
    assert messages.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    sequence = [e.sequence_number for e in events]
    assert sequence == sorted(set(sequence)), sequence
    assert events[-1].code == "store_unavailable"  # type: ignore[union-attr]
    assert turns(api, session) == []
