"""Streamed answers under the server's latency bound, ``stream_interval_ms``: the first tokens
go out at once, later ones wait at most the bound to go out together in one chunk, the end goes
out at once, and what the client is served and what is recorded do not depend on the bound.

The engine is the stub engine (bench/stub_engine.py: SGLang's protocol, no model) in a thread of
its own, whose streamed ``/generate`` plays a script: writes of token ids, each after a pause,
each write one or more SSE events. Three proxies (``create_app`` served by uvicorn in threads of
this process, real HTTP on 127.0.0.1) share it: the bound off (0), short (5 ms) and long (1 s,
far past any pause of a script but the held one, so what the long bound holds is unmistakable
in time). Each stream is read by the real SDK of its surface. The machine's two cores are
shared with other work: every time bound below is at least 0.4 s from what the code under test
does, and at least 0.5 s from the bound it tells apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.stub_engine import Stub, read_body
from bench.stub_engine import create_app as create_stub_app
from server.text.tokenization import Tokenizer
from tests.api.api_support import ADMIN_KEY, app_settings

START_TIMEOUT_S = 30.0
OFF, SHORT, LONG = 0.0, 5.0, 1000.0  # the proxies' stream_interval_ms
SSE_HEADERS = [(b"content-type", b"text/event-stream")]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
CALL_TEXT = (
    'Checking the sky: "ça va" 🌧 日本.\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Zürich 🌧 東京"}}\n</tool_call>'
)
PLAIN_TEXT = "Zürich, 東京 and 🙂: the weather is fine, ça va. " * 2


@dataclass
class Write:
    """One write of the engine's stream, ``pause_s`` after the one before: an SSE event per
    group of token ids."""

    groups: list[list[int]]
    pause_s: float = 0.0


@dataclass
class Script:
    """What the engine streams for one ``/generate`` call, and how it ends."""

    writes: list[Write]
    finish: dict | None
    version: str = "0"
    error: dict | None = None  # an in-band error event after the last write's events
    sent_last_at: float = 0.0  # time.monotonic() of its last write (set by the engine)
    disconnected_at: float = 0.0  # when the proxy hung up before the end (set by the engine)


@dataclass
class ScriptedEngine:
    """The stub engine whose ``/generate`` plays ``scripts``, one per call, in order."""

    stub: Stub
    scripts: list[Script] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)

    def app(self):
        stub_app = create_stub_app(self.stub)

        async def app(scope, receive, send) -> None:
            if scope["type"] != "http" or scope["path"] != "/generate":
                await stub_app(scope, receive, send)
                return
            body = await read_body(receive)
            if not self.scripts:  # the proxy's own probes: the stub's made-up answer

                async def replay() -> dict:
                    return {"type": "http.request", "body": body, "more_body": False}

                await stub_app(scope, replay, send)
                return
            request = json.loads(body)
            self.bodies.append(request)
            await self._play(self.scripts.pop(0), request, receive, send)

        return app

    async def _play(self, script: Script, request: dict, receive, send) -> None:
        rid, prompt = request["rid"], len(request["input_ids"])
        ids = [i for write in script.writes for group in write.groups for i in group]
        if not request.get("stream"):
            chunk = self._output(script, rid, ids, 0, len(ids), script.finish, prompt)
            payload = json.dumps(chunk).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        hung_up = asyncio.ensure_future(receive())  # http.disconnect, if the proxy leaves
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        done = 0
        try:
            for number, write in enumerate(script.writes):
                if write.pause_s:
                    await asyncio.wait({hung_up}, timeout=write.pause_s)
                if hung_up.done():
                    script.disconnected_at = time.monotonic()
                    return
                data = b""
                for place, group in enumerate(write.groups):
                    last = number == len(script.writes) - 1 and place == len(write.groups) - 1
                    finish = script.finish if last else None
                    chunk = self._output(script, rid, ids, done, done + len(group), finish, prompt)
                    done += len(group)
                    data += b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if script.error and number == len(script.writes) - 1:
                    data += b"data: " + json.dumps({"error": script.error}).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": data, "more_body": True})
            script.sent_last_at = time.monotonic()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            hung_up.cancel()

    def _output(
        self, script: Script, rid: str, ids: list[int], start: int, end: int, finish, prompt: int
    ) -> dict:
        logprobs = [-0.01 - 0.1 * (i % 7) for i in range(start, end)]
        output = self.stub.output(rid, ids[start:end], logprobs, finish, prompt, end)
        output["meta_info"]["weight_version"] = script.version  # the swap's (health: the stub's)
        return output


class Served:
    """An ASGI app served by uvicorn in a thread of this process, on a loopback socket."""

    def __init__(self, app) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@dataclass
class Proxy:
    url: str

    def session(self) -> dict:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        reply = httpx.post(f"{self.url}/rl/sessions", json={}, headers=headers, timeout=30)
        assert reply.status_code == 201, reply.text
        return reply.json()

    def turns(self, session: dict) -> list[dict]:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        url = f"{self.url}/rl/sessions/{session['session_id']}"
        reply = httpx.get(url, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["turns"]

    def openai(self, session: dict) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=session["api_key"], max_retries=0)

    def anthropic(self, session: dict) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=session["api_key"], max_retries=0)


@dataclass
class Setup:
    engine: ScriptedEngine
    engine_url: str
    tokenizer: Tokenizer
    proxies: dict[float, Proxy]

    def ids(self, text: str) -> list[int]:
        """``text``'s tokens and the end of sequence."""
        return [*self.tokenizer.encode(text), self.engine.stub.eos]

    def script(self, text: str, pause_s: float = 0.002, **kwargs: Any) -> Script:
        """``text`` and the end of sequence, a token per write, ``pause_s`` apart."""
        ids = self.ids(text)
        writes = [Write([[token]], pause_s if i else 0.0) for i, token in enumerate(ids)]
        return Script(writes, {"type": "stop", "matched": self.engine.stub.eos}, **kwargs)


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Setup]:
    from server.main import create_app

    engine = ScriptedEngine(Stub(tiny_model_dir, 16))
    with contextlib.ExitStack() as stack:
        engine_url = stack.enter_context(Served(engine.app())).url
        proxies: dict[float, Proxy] = {}
        for bound in (OFF, SHORT, LONG):
            data_dir = tmp_path_factory.mktemp(f"interval-{bound:g}")
            app = create_app(
                app_settings(tiny_model_dir, engine_url, data_dir, stream_interval_ms=bound)
            )
            proxies[bound] = Proxy(stack.enter_context(Served(app)).url)
        yield Setup(engine, engine_url, Tokenizer.from_pretrained(tiny_model_dir), proxies)


USER = [{"role": "user", "content": "What is the weather?"}]
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def chat(setup: Setup, bound: float, script: Script, tools: bool = True) -> tuple[Any, list]:
    """A streamed chat: what it served (content, tool calls, finish, usage), and its chunks with
    the time each came."""
    setup.engine.scripts = [script]
    proxy = setup.proxies[bound]
    client = proxy.openai(session := proxy.session())
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        **({"tools": CHAT_TOOLS} if tools else {}),
    )
    chunks = [(time.monotonic(), chunk) for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for _, c in chunks if c.choices)
    calls = [
        (call.function.name, json.loads(call.function.arguments))
        for _, c in chunks
        if c.choices
        for call in c.choices[0].delta.tool_calls or []
        if call.function and call.function.name
    ]
    finish = [c.choices[0].finish_reason for _, c in chunks if c.choices][-1]
    usage = chunks[-1][1].usage
    (turn,) = proxy.turns(session)
    return (content, calls, finish, usage.model_dump(), _recorded(turn)), chunks


def _recorded(turn: dict) -> tuple:
    return turn["completion_ids"], turn["logprobs"], turn["versions"]


def completion(setup: Setup, bound: float, script: Script) -> tuple[Any, list]:
    setup.engine.scripts = [script]
    proxy = setup.proxies[bound]
    client = proxy.openai(session := proxy.session())
    stream = client.completions.create(
        model="tiny",
        prompt="The weather:",
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [(time.monotonic(), chunk) for chunk in stream]
    text = "".join(c.choices[0].text for _, c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for _, c in chunks if c.choices][-1]
    usage = chunks[-1][1].usage.model_dump()
    (turn,) = proxy.turns(session)
    return (text, finish, usage, _recorded(turn)), chunks


def responses(setup: Setup, bound: float, script: Script) -> tuple[Any, list]:
    setup.engine.scripts = [script]
    proxy = setup.proxies[bound]
    client = proxy.openai(session := proxy.session())
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    with client.responses.stream(
        model="tiny", input="What is the weather?", max_output_tokens=200, tools=tools
    ) as stream:
        events = [(time.monotonic(), event) for event in stream]
        response = stream.get_final_response()
    served = [
        (item.type, getattr(item, "name", None), getattr(item, "arguments", None))
        for item in response.output
    ]
    usage = response.usage.model_dump() if response.usage else None
    (turn,) = proxy.turns(session)
    return (response.output_text, served, response.status, usage, _recorded(turn)), events


def messages(setup: Setup, bound: float, script: Script) -> tuple[Any, list]:
    setup.engine.scripts = [script]
    proxy = setup.proxies[bound]
    client = proxy.anthropic(session := proxy.session())
    tools: Any = [{"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}]
    with client.messages.stream(model="tiny", messages=USER, max_tokens=200, tools=tools) as stream:
        events = [(time.monotonic(), event) for event in stream]
        message = stream.get_final_message()
    blocks = [
        (block.type, getattr(block, "text", None), getattr(block, "input", None))
        for block in message.content
    ]
    usage = (message.usage.input_tokens, message.usage.output_tokens)
    (turn,) = proxy.turns(session)
    return (blocks, message.stop_reason, usage, _recorded(turn)), events


SURFACES = {"chat": chat, "completions": completion, "responses": responses, "messages": messages}


@pytest.mark.parametrize("surface", SURFACES)
def test_each_surface_serves_the_same_answer_in_fewer_chunks_under_the_bound(
    setup: Setup, surface: str
):
    """Text, tool calls, finish and usage as with the bound off, and the same tokens recorded
    (ids, logprobs, versions); a token per engine write, 2 ms apart, goes out in fewer chunks."""
    run = SURFACES[surface]
    text = PLAIN_TEXT if surface == "completions" else CALL_TEXT
    served_off, chunks_off = run(setup, OFF, setup.script(text))
    served_on, chunks_on = run(setup, LONG, setup.script(text))
    assert served_on == served_off
    if surface == "chat":
        assert served_on[1] == [("get_weather", {"city": "Zürich 🌧 東京"})], served_on
    if surface == "completions":
        assert served_on[0] == PLAIN_TEXT, served_on
    # the bound off: a chunk per token of text (a tool call's go out in one); the long bound:
    # the start and the first token, then everything else with the end
    assert len(chunks_on) + 10 < len(chunks_off), (len(chunks_on), len(chunks_off))


def _content_times(chunks: list) -> list[float]:
    return [at for at, c in chunks if c.choices and c.choices[0].delta.content]


def test_the_first_chunk_and_the_end_are_not_held_by_the_bound(setup: Setup):
    """The long bound (1 s): the first token's chunk comes as soon as the bound off's does
    (well within half the bound of the request), and the end as soon as the engine's last
    write (within half the bound of it), not a bound later."""
    script = setup.script(PLAIN_TEXT, pause_s=0.002)
    started = time.monotonic()
    _, chunks = chat(setup, LONG, script, tools=False)
    first = _content_times(chunks)[0]
    assert first - started < LONG / 2000, first - started
    assert chunks[-1][0] - script.sent_last_at < LONG / 2000, chunks[-1][0] - script.sent_last_at
    assert len(_content_times(chunks)) == 2, len(_content_times(chunks))  # the first, the rest


def test_a_token_waits_at_most_the_bound(setup: Setup):
    """The engine sends a token, another 10 ms later, then nothing for 2.5 s: the second goes
    out one bound (1 s) after the stream took it up, long before the engine's next write."""
    ids = setup.ids("Zürich 東京 🙂 done")
    writes = [Write([ids[:3]]), Write([ids[3:6]], 0.01), Write([ids[6:]], 2.5)]
    script = Script(writes, {"type": "stop", "matched": setup.engine.stub.eos})
    served, chunks = chat(setup, LONG, script, tools=False)
    times = _content_times(chunks)
    assert 0.8 < times[1] - times[0] < 2.0, [t - times[0] for t in times]
    assert served[0] == "Zürich 東京 🙂 done"


def test_several_engine_events_in_one_write_go_out_as_one_delta(setup: Setup):
    """An engine that got ahead: its events of one write are one piece, served in one chunk
    even with the bound off; every token is recorded once, with its logprob."""
    ids = setup.ids("one two three four five six")
    writes = [Write([[token] for token in ids[:4]]), Write([[token] for token in ids[4:]], 0.2)]
    script = Script(writes, {"type": "stop", "matched": setup.engine.stub.eos})
    served, chunks = chat(setup, OFF, script, tools=False)
    assert len(_content_times(chunks)) == 2, [c.choices for _, c in chunks]
    assert served[0] == "one two three four five six"
    recorded_ids, logprobs, _ = served[-1]
    assert recorded_ids == ids
    expected = [-0.01 - 0.1 * (i % 7) for i in range(len(ids))]
    assert logprobs == pytest.approx(expected, rel=1e-6)  # the store keeps float32 (2**-23)


def test_a_swap_mid_stream_under_the_bound_serves_and_records_every_token_once(setup: Setup):
    """The engine aborts the request after some tokens (a weight swap); the proxy resubmits the
    rest, which the engine answers at version 1. The client gets the whole text once and the
    turn records each token once, with the version that sampled it."""
    ids = setup.ids("Before the swap, and after it: 東京 🙂")
    cut = 9
    aborted = Script(
        [Write([[token]], 0.002) for token in ids[:cut]], {"type": "abort", "message": "paused"}
    )
    rest = Script(
        [Write([[token]], 0.002) for token in ids[cut:]],
        {"type": "stop", "matched": setup.engine.stub.eos},
        version="1",
    )
    for bound in (SHORT, LONG):
        setup.engine.scripts = [aborted, rest]
        proxy = setup.proxies[bound]
        client = proxy.openai(session := proxy.session())
        stream = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=200, stream=True
        )
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        (turn,) = proxy.turns(session)
        assert content == "Before the swap, and after it: 東京 🙂"
        assert turn["completion_ids"] == ids
        assert turn["versions"] == [0] * cut + [1] * (len(ids) - cut), turn["versions"]
        resumed = setup.engine.bodies[-1]
        assert resumed["input_ids"][-cut:] == ids[:cut]


def test_a_client_that_leaves_mid_hold_aborts_the_engine_request(setup: Setup):
    """The client reads the first chunk and hangs up while the proxy holds the second (the long
    bound, 1 s): the proxy lets go of the engine's request at once, not at the hold's end."""
    ids = setup.ids("Hello there, anyone?")
    writes = [Write([ids[:2]]), Write([ids[2:4]], 0.01), Write([ids[4:]], 5.0)]
    script = Script(writes, {"type": "stop", "matched": setup.engine.stub.eos})
    setup.engine.scripts = [script]
    proxy = setup.proxies[LONG]
    session = proxy.session()
    body = {"model": "tiny", "messages": USER, "max_tokens": 200, "stream": True}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, r.read()
        next(r.iter_raw())  # the first chunk: the start and the first tokens
        time.sleep(0.1)  # the second write is in, held
        left = time.monotonic()
    deadline = left + 3.0
    while not script.disconnected_at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert script.disconnected_at, "the engine's request went on"
    assert script.disconnected_at - left < 0.5, script.disconnected_at - left


def test_the_bound_is_checked_at_start():
    from pydantic import ValidationError

    from server.settings import ServerSettings

    for bad in (-1, 1001, float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="stream_interval_ms"):
            ServerSettings(model="m", stream_interval_ms=bad)
    assert ServerSettings(model="m").stream_interval_ms == 20.0


# Text with multi-byte characters (byte-level tokens cut them) and a tool call, cut anywhere.
TEXTS = st.sampled_from(
    [CALL_TEXT, PLAIN_TEXT, "🙂" * 5 + " é日本 <tool_call>{not json</tool_call> x"]
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=TEXTS, data=st.data())
def test_any_split_into_engine_events_serves_the_same_answer(setup: Setup, text: str, data):
    """However the engine splits the tokens into events and writes (and the pauses between
    them), the short and the long bound serve what the bound off serves for one token per
    write: the same content, tool calls, finish and usage, and the same tokens recorded."""
    ids = setup.ids(text)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids) - 1)))
    groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    writes: list[Write] = []
    for group in groups:
        if writes and data.draw(st.booleans()):
            writes[-1].groups.append(group)  # in the same write as the event before
        else:
            writes.append(Write([group], data.draw(st.sampled_from([0.0, 0.001, 0.004, 0.008]))))
    finish = {"type": "stop", "matched": setup.engine.stub.eos}
    reference, _ = chat(setup, OFF, setup.script(text, pause_s=0.0))
    for bound in (SHORT, LONG):
        split = Script([Write(list(w.groups), w.pause_s) for w in writes], finish)
        served, _ = chat(setup, bound, split)
        assert served == reference


def _body_writes(url: str, path: str, key: str, body: dict) -> list[bytes]:
    """The body of a POST as its server wrote it: one HTTP/1.1 chunk per write (what a client
    library's reads merge or split, the chunked framing keeps)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + payload)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    headers, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in headers.lower(), headers
    writes = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return writes
        writes.append(rest[:size])
        rest = rest[size + 2 :]


def test_the_last_tokens_go_out_with_the_end_in_one_write(setup: Setup):
    """A stream of 16 tokens 2 ms apart under the long bound is two writes: the start with the
    first token, then the rest with the finish, the usage and [DONE] (the record was done long
    before the rest were due). The bound off: a write per token, and the end."""
    text = "One two three four five six seven eight nine ten eleven twelve"
    ids = setup.ids(text)
    session = setup.proxies[LONG].session()
    body = {"model": "tiny", "messages": USER, "max_tokens": 200, "stream": True}
    body["stream_options"] = {"include_usage": True}
    setup.engine.scripts = [setup.script(text)]
    writes = _body_writes(setup.proxies[LONG].url, "/v1/chat/completions", session["api_key"], body)
    assert len(writes) == 2, writes
    assert writes[1].endswith(b"data: [DONE]\n\n") and b'"usage": {' in writes[1], writes[1]
    off = setup.proxies[OFF].session()
    setup.engine.scripts = [setup.script(text)]
    writes = _body_writes(setup.proxies[OFF].url, "/v1/chat/completions", off["api_key"], body)
    assert len(writes) >= len(ids) - 2, writes  # a token may wait for a neighbour's bytes


def test_the_engine_client_reads_the_events_of_one_write_as_one_piece(setup: Setup):
    """Events that came in one read are parsed in one go, as one piece (tokens, logprobs and
    versions in order, the finish of the last); an in-band error after some events keeps them
    (a resume starts after them) and then raises."""
    import aiohttp

    from server.engine_client.client import EngineClient
    from server.errors import EngineUnavailable

    ids = setup.ids("one two three four five")
    finish = {"type": "stop", "matched": setup.engine.stub.eos}

    async def pieces(script: Script) -> tuple[list, BaseException | None]:
        setup.engine.scripts = [script]
        got: list = []
        async with aiohttp.ClientSession() as http:
            client = EngineClient(setup.engine_url, http, 30.0)
            body = {"input_ids": [1, 2, 3], "sampling_params": {}, "rid": "r-0"}
            try:
                async for piece in client.generate_stream(body, incremental=True):
                    got.append(piece)
            except EngineUnavailable as exc:
                return got, exc
        return got, None

    script = Script([Write([[t] for t in ids[:4]]), Write([[t] for t in ids[4:]], 0.05)], finish)
    got, error = asyncio.run(pieces(script))
    assert error is None
    assert [piece.ids for piece in got] == [ids[:4], ids[4:]]
    assert [len(piece.logprobs) for piece in got] == [4, len(ids) - 4]
    assert got[0].versions == ["0"] * 4 and got[0].finish_reason is None
    assert got[1].finish_reason == finish

    failing = Script([Write([[t] for t in ids[:3]])], None, error={"message": "out of memory"})
    got, error = asyncio.run(pieces(failing))
    assert [piece.ids for piece in got] == [ids[:3]]
    assert isinstance(error, EngineUnavailable) and "out of memory" in str(error), error
