"""A stub engine: SGLang's native protocol as proxrl speaks it, and no model, for the benches
that measure the proxy's own cost (bench/proxy_cost.py, bench/replicas.py).

``python bench/stub_engine.py --model DIR --port PORT [--tokens 16]`` serves on 127.0.0.1:

- ``POST /generate``, streamed (incremental chunks, ``stream_interval`` tokens each) or not:
  ``min(--tokens, max_new_tokens)`` tokens, made up from the prompt's length, the rid and the
  ``sampling_seed`` (the same request always gets the same tokens), with made-up logprobs
  (``--chunk-interval-ms`` apart when streamed); an
  answer shorter than ``max_new_tokens`` ends with the model's end-of-sequence token
  (``finish_reason`` stop), one of exactly ``max_new_tokens`` with ``length``;
- ``/model_info``, ``/server_info`` (tp, dp and pp size 1, a context length, incremental
  streaming), ``/v1/models``, ``/v1/loads``, ``/health``, ``/health_generate``, ``/ready``;
- the pause, continue, abort, flush and weight-update routes, answered at once (a pause holds
  new ``/generate`` calls until the continue, as SGLang's does; an update sets the version).

It knows nothing of tokens but their ids: the model directory gives only the vocabulary size and
the end-of-sequence id (``config.json``), which the proxy's tokenizer must agree with. Raw ASGI
on uvicorn (uvloop + httptools) and the standard json module, as bench/forwarder.py: per request
it does a JSON parse and a few small JSON answers, so the engine's CPU is small beside the
proxy's. It is not SGLang: no batching, no KV cache, no context check beyond the length, no
error shapes beyond a 400 for a body it cannot read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import uvicorn

CONTEXT_LENGTH = 2048
# Made-up tokens come from this range of ids: past the tiny model's special tokens (the lowest
# ids) and short of its tool markup (the highest).
FIRST_ID = 64
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Stub:
    """The stub's state: its weight version, whether it is paused, counters."""

    def __init__(self, model_dir: Path, tokens: int, chunk_interval_s: float = 0.0) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.span = max(int(config["vocab_size"]) - 2 * FIRST_ID, 1)
        self.model_path = str(model_dir)
        self.name = model_dir.name
        self.tokens = tokens
        self.chunk_interval_s = chunk_interval_s
        self.version = "0"
        self.started = time.time()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.generated = 0

    def answer(self, body: dict) -> tuple[list[int], list[float], dict, int]:
        """The request's made-up tokens, their logprobs, its finish reason, its prompt length."""
        prompt = body.get("input_ids") or []
        params = body.get("sampling_params") or {}
        budget = int(params.get("max_new_tokens") or 128)
        count = min(self.tokens, budget)
        seed = hash((len(prompt), body.get("rid"), params.get("sampling_seed"))) & 0xFFFF
        ids = [FIRST_ID + (seed + 37 * i) % self.span for i in range(count)]
        if count < budget:  # ends on its own: the end-of-sequence token is the last
            ids[-1] = self.eos
            finish: dict = {"type": "stop", "matched": self.eos}
        else:
            finish = {"type": "length", "length": count}
        logprobs = [-0.05 - 0.1 * ((seed + i) % 7) for i in range(count)]
        self.generated += count
        return ids, logprobs, finish, len(prompt)

    def output(
        self, rid: str, ids: list[int], logprobs: list[float], finish, prompt: int, done: int
    ) -> dict:
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "cached_tokens": 0,
                "weight_version": self.version,
                "output_token_logprobs": [
                    [lp, i, None] for lp, i in zip(logprobs, ids, strict=True)
                ],
            },
        }

    def info(self, path: str) -> dict | None:
        if path in ("/model_info", "/get_model_info"):
            return {
                "model_path": self.model_path,
                "served_model_name": self.name,
                "is_generation": True,
                "weight_version": self.version,
            }
        if path in ("/server_info", "/get_server_info"):
            return {
                "model_path": self.model_path,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "context_length": CONTEXT_LENGTH,
                "incremental_streaming_output": True,
                "weight_version": "0",
                "version": "stub",
            }
        if path == "/v1/models":
            card = {"id": self.name, "object": "model", "owned_by": "stub"}
            return {"object": "list", "data": [{**card, "max_model_len": CONTEXT_LENGTH}]}
        if path == "/v1/loads":
            return {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]}
        return None

    def control(self, path: str, body: dict) -> dict | None:
        """The control routes: pause, continue, abort, flush, weight updates."""
        if path == "/pause_generation":
            self.resumed.clear()
            return {"success": True, "message": "paused"}
        if path == "/continue_generation":
            self.resumed.set()
            return {"message": "continued", "status": "ok"}
        if path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
            self.version = str(body.get("weight_version", self.version))
            return {"success": True, "message": "stub: nothing loaded"}
        if path == "/update_weight_version":
            self.version = str(body.get("new_version", self.version))
            return {"success": True, "message": ""}
        if path in (
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/begin_weight_update",
            "/end_weight_update",
            "/abort_request",
            "/flush_cache",
        ):
            return {"success": True, "message": ""}
        return None


async def read_body(receive) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _send_json(send, status: int, value) -> None:
    payload = json.dumps(value).encode()
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": payload})


async def _generate(stub: Stub, body: dict, send) -> None:
    await stub.resumed.wait()  # a paused engine holds new requests, as SGLang's does
    rid = str(body.get("rid") or "stub")
    ids, logprobs, finish, prompt = stub.answer(body)
    if not body.get("stream"):
        await _send_json(send, 200, stub.output(rid, ids, logprobs, finish, prompt, len(ids)))
        return
    interval = max(int((body.get("sampling_params") or {}).get("stream_interval") or 1), 1)
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    for start in range(0, len(ids), interval):
        end = min(start + interval, len(ids))
        last = end == len(ids)
        chunk = stub.output(
            rid, ids[start:end], logprobs[start:end], finish if last else None, prompt, end
        )
        data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})
        if stub.chunk_interval_s and not last:
            await asyncio.sleep(stub.chunk_interval_s)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def create_app(stub: Stub):
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            info = stub.info(path)
            if info is not None:
                await _send_json(send, 200, info)
            elif path == "/flush_cache":
                await _send_json(send, 200, "ok")
            else:  # /health, /health_generate, /ready and anything else
                known = path in ("/health", "/health_generate", "/ready")
                await send({"type": "http.response.start", "status": 200 if known else 404})
                await send({"type": "http.response.body", "body": b""})
            return
        try:
            body = json.loads(await read_body(receive) or b"{}")
        except ValueError:
            await _send_json(send, 400, {"error": "the body is not JSON"})
            return
        if path == "/generate":
            await _generate(stub, body, send)
            return
        answer = stub.control(path, body)
        await _send_json(send, 404 if answer is None else 200, answer or {"error": "not found"})

    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="The model directory.")
    parser.add_argument("--port", type=int, required=True, help="Port on 127.0.0.1.")
    parser.add_argument(
        "--tokens", type=int, default=16, help="Tokens per answer, at most (default: 16)."
    )
    parser.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=0.0,
        help="Pause between a stream's chunks, so that each reaches the client on its own as "
        "from a real engine's decode steps (default: 0, none).",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    uvicorn.run(
        create_app(Stub(args.model, args.tokens, args.chunk_interval_ms / 1000)),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
    )
