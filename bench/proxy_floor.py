"""The least CPU any proxy that records exact tokens must spend on a non-streamed chat, beside
what a bare forwarder spends on the whole request, in one run: how far below the proxy's cost a
redesign of its hot path could go.

A proxy that captures every token exactly must, per request and on top of what the forwarder
does (receive a body, call the engine, send the answer): read the chat request (JSON and its
validation), render the chat template and tokenize the prompt, write the engine's body, read the
engine's answer (token ids and logprobs), decode the ids into the answer's text, write the
OpenAI answer, and record the turn. This bench times each of those steps in this process, in a
hot loop over the same chats as bench/proxy_cost.py (the project's own code for each step:
``ChatCompletionRequest``, ``Tokenizer.render_prompt`` + ``encode_prompt``, ``engine_body``,
``piece_from_output`` on a real stub answer, ``Tokenizer.decode``), with no framework, no event
loop and no store, and measures the bare forwarder (bench/forwarder.py) in front of the stub
engine (bench/stub_engine.py) as bench/proxy_cost.py does, 8 clients. The steps in a hot loop
run with warm caches, cheaper than inside a server; the record is left out. The sum is therefore
a lower bound on the proxy's own work, and forwarder + that sum a lower bound on any such proxy's
CPU per request.

Reported: each step's CPU per request, their sum, the forwarder's CPU per request, and the floor
ratio (forwarder + steps) / forwarder, the best a proxy that does the steps could reach against
issue 27's "at most 2x a bare forwarder". Results go to stdout and bench/results/proxy_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp  # noqa: E402

from bench.common import Forwarder, StubEngine, per_client, positive_int, process_cpu  # noqa: E402
from bench.proxy import ChatRequest, ensure_model, make_requests  # noqa: E402
from bench.proxy_cost import TIMEOUT, forwarder_send  # noqa: E402
from server.engine_client.client import piece_from_output  # noqa: E402
from server.proxy.generation import SamplingRequest, engine_body  # noqa: E402
from server.proxy.schemas import ChatCompletionRequest  # noqa: E402
from server.store import database, runs, sessions  # noqa: E402
from server.store.turns import TurnInserter, TurnRecord  # noqa: E402
from server.text.tokenization import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "proxy_floor.json"
LOG_DIR = ROOT / ".cache" / "bench"
SEED = 0
TOKENS = 16
TARGET = 2.0
BATCH = 8  # turns per store transaction: what the turn writer batches with 8 clients at once


@contextmanager
def turn_store() -> Iterator[Callable[[ChatRequest, list[int], str], None]]:
    """A migrated SQLite store under a temporary directory, with a run and a session; yields
    ``record(chat, ids, text)``, which hands the turn to a writer that commits every ``BATCH``
    turns through the server's own ``TurnInserter``."""
    with tempfile.TemporaryDirectory(prefix="proxrl-floor-") as directory:
        url = database.default_url(Path(directory))
        database.upgrade(url)
        run_id, session_id = asyncio.run(_run_and_session(url))
        engine = database.connect_sync(url)
        inserter, raw, waiting = TurnInserter(engine.dialect), engine.raw_connection(), []
        turns = [0]

        def record(chat: ChatRequest, ids: list[int], text: str) -> None:
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            waiting.append(
                TurnRecord(
                    session_id=session_id, run_id=run_id, completion_id=completion_id,
                    request_id=completion_id, surface="chat", model="tiny",
                    turn_index=turns[0], row_index=turns[0], extends_previous=False,
                    conversation=turns[0], messages=chat.messages, tools=None,
                    response={"content": text}, prompt_ids=chat.prompt_ids, completion_ids=ids,
                    logprobs=[-0.5] * len(ids), versions=[0] * len(ids), finish_reason="stop",
                    sampling={"temperature": 1.0, "max_tokens": 2 * TOKENS, "stop": [],
                              "seed": chat.seed, "n": 1},
                    engine="http://127.0.0.1:30000", resubmits=0, new_row=True,
                    new_conversation=True,
                )
            )  # fmt: skip
            turns[0] += 1
            if len(waiting) == BATCH:
                inserter(raw, waiting)
                waiting.clear()

        try:
            yield record
        finally:
            raw.close()
            engine.dispose()


async def _run_and_session(url: str) -> tuple[str, str]:
    """A run and a session of it, made as the server makes them."""
    engine = database.connect(url)
    try:
        async with database.sessionmaker(engine)() as db:
            run, _ = await runs.create_run(db, "floor", "tiny", {})
            session, _ = await sessions.create_session(db, run.id, "bench", None, {})
            await db.commit()
            return run.id, session.id
    finally:
        await engine.dispose()


def steps(
    tokenizer: Tokenizer, answer: bytes, record: Callable[[ChatRequest, list[int], str], None]
) -> dict[str, Callable[[ChatRequest], Any]]:
    """Each step of the proxy's own work on one chat, as a function of the chat."""

    def request(chat: ChatRequest) -> Any:
        body = {"model": "tiny", "messages": chat.messages, "max_tokens": 2 * TOKENS}
        text = json.dumps(body | {"temperature": 1.0, "seed": chat.seed}).encode()
        return ChatCompletionRequest.model_validate(json.loads(text))

    def prompt(chat: ChatRequest) -> list[int]:
        return tokenizer.encode_prompt(tokenizer.render_prompt(chat.messages))

    def engine_request(chat: ChatRequest) -> bytes:
        sampling = SamplingRequest(chat.prompt_ids, 2 * TOKENS, 1.0, seed=chat.seed)
        return json.dumps(engine_body(sampling, [], "bench-0")).encode()

    def engine_answer(chat: ChatRequest) -> Any:
        return piece_from_output(json.loads(answer))

    ids = piece_from_output(json.loads(answer)).ids

    def decode(chat: ChatRequest) -> str:
        return tokenizer.decode(ids)

    text = tokenizer.decode(ids)

    def response(chat: ChatRequest) -> bytes:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        usage = {"prompt_tokens": len(chat.prompt_ids), "completion_tokens": len(ids)}
        body = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "tiny"}
        return json.dumps(body | {"choices": [choice | {"finish_reason": "stop"}], "usage": usage})

    def store(chat: ChatRequest) -> None:
        record(chat, ids, text)

    return {
        "read and validate the request": request,
        "render the template and tokenize": prompt,
        "write the engine's body": engine_request,
        "read the engine's answer": engine_answer,
        "decode the answer's ids": decode,
        "write the answer": response,
        f"record the turn (SQLite, {BATCH} turns a commit)": store,
    }


def time_step(step: Callable[[ChatRequest], Any], chats: list[ChatRequest], repeat: int) -> float:
    """CPU ms per call of ``step`` over ``chats``, the median of ``repeat`` passes."""
    passes = []
    for _ in range(repeat):
        started = time.process_time()
        for chat in chats:
            step(chat)
        passes.append(1000 * (time.process_time() - started) / len(chats))
    return statistics.median(passes)


async def stub_answer(url: str, chat: ChatRequest) -> bytes:
    """A real non-streamed answer of the stub engine to ``chat``."""
    sampling = SamplingRequest(chat.prompt_ids, 2 * TOKENS, 1.0, seed=chat.seed)
    body = engine_body(sampling, [], "bench-0")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as http,
        http.post(f"{url}/generate", json=body) as reply,
    ):
        reply.raise_for_status()
        return await reply.read()


async def forwarder_phase(url: str, clients: list[list[ChatRequest]], pid: int) -> float:
    """The forwarder's CPU ms per request, every client at once."""
    connector = aiohttp.TCPConnector(limit=len(clients) + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as http:

        async def client(requests: list[ChatRequest]) -> None:
            for chat in requests:
                await forwarder_send(http, url, chat, False, TOKENS)

        before = process_cpu(pid)
        await asyncio.gather(*(client(c) for c in clients))
        spent = process_cpu(pid) - before
    return 1000 * spent / sum(len(c) for c in clients)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=800,
        help="Requests per forwarder round, and chats per step pass (default: 800).",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="Forwarder rounds and step passes; medians are reported (default: 3).",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    model_dir = ensure_model()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    chats = make_requests(tokenizer, random.Random(SEED), args.requests)
    clients = per_client(chats, 8)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with (
        StubEngine(model_dir, LOG_DIR / "proxy-floor-stub.log", TOKENS) as stub,
        Forwarder(stub.url, LOG_DIR / "proxy-floor-forwarder.log") as forwarder,
    ):
        answer = asyncio.run(stub_answer(stub.url, chats[0]))
        pid = forwarder.process.pid
        asyncio.run(forwarder_phase(forwarder.url, [c[:10] for c in clients], pid))  # warm-up
        forwarded = []
        for round_ in range(args.rounds):
            forwarded.append(asyncio.run(forwarder_phase(forwarder.url, clients, pid)))
            print(f"  forwarder round {round_ + 1}: {forwarded[-1]:.3f} ms CPU/req", flush=True)
    measured = {}
    with turn_store() as record:
        for name, step in steps(tokenizer, answer, record).items():
            step(chats[0])  # warm-up
            measured[name] = time_step(step, chats, args.rounds)
            print(f"  {name}: {1000 * measured[name]:.0f} us/req", flush=True)
    work = sum(measured.values())
    forwarder_ms = statistics.median(forwarded)
    floor = (forwarder_ms + work) / forwarder_ms
    lines = ["| per request | CPU us |", "|---|---:|"]
    lines += [f"| {name} | {1000 * ms:.0f} |" for name, ms in measured.items()]
    lines += [
        f"| **the proxy's own steps, in all** | **{1000 * work:.0f}** |",
        f"| the bare forwarder, the whole request | {1000 * forwarder_ms:.0f} |",
    ]
    table = "\n".join(lines)
    print(f"\n{table}\n")
    verdict = "within" if floor <= TARGET else "above"
    print(f"floor: (forwarder + steps) / forwarder = {floor:.2f}x, {verdict} the {TARGET}x target")
    print(f"total {time.perf_counter() - started:.0f}s")
    report = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "args": vars(args),
        "steps_ms": measured,
        "steps_total_ms": work,
        "forwarder_ms": forwarder_ms,
        "forwarder_rounds_ms": forwarded,
        "floor_ratio": floor,
        "table": table,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
