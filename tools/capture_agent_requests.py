"""A loopback stand-in for a model API that records every request an agent sends.

Run an agent (Claude Code, the Codex CLI, ...) against it to read the exact requests of its
current release: method, path, headers (keys redacted) and JSON bodies, one JSON object per line
in ``--log``. Each generation is answered with a minimal, well-formed stream (or JSON body when
``stream`` is false) in the chosen surface's shape:

- ``messages``: Anthropic's Messages API (``POST /v1/messages``, ``.../count_tokens``);
- ``responses``: OpenAI's Responses API (``POST /v1/responses``);
- ``chat``: OpenAI's Chat Completions (``POST /v1/chat/completions``).

With ``--tool NAME --tool-input JSON`` the first generation that offers a tool of that name is
answered with a call of it, so the agent runs the tool and the next request carries its result;
every other generation answers ``--text``. ``HEAD``/``GET`` of any other path answer 200 with an
empty JSON object (``/v1/models`` a one-model list), so probes are recorded, not refused.

    python tools/capture_agent_requests.py --surface messages --port 8765 --log /tmp/cc.jsonl \\
        --tool Bash --tool-input '{"command": "echo hi"}'

Nothing here reaches beyond 127.0.0.1; it is a development tool, not part of proxrl.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie"}


class Capture:
    """What to answer, the log, and whether the scripted tool call was made yet."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.surface: str = args.surface
        self.text: str = args.text
        self.tool: str | None = args.tool
        self.tool_input: dict = json.loads(args.tool_input)
        self.log_path: str = args.log
        self.called = False
        self.lock = threading.Lock()
        self.count = 0

    def record(self, entry: dict) -> None:
        with self.lock:
            self.count += 1
            entry = {"n": self.count, "time": time.time(), **entry}
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def scripted_call(self, body: dict) -> tuple[str, dict] | None:
        """The tool call this generation is answered with: the scripted one, the first time a
        request offers its tool; else None."""
        with self.lock:
            if self.tool is None or self.called or self.tool not in _tool_names(body):
                return None
            self.called = True
            return self.tool, self.tool_input


def _tool_names(body: dict) -> set[str]:
    names = set()
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            name = tool.get("name") or (tool.get("function") or {}).get("name")
            if isinstance(name, str):
                names.add(name)
    return names


# ----- answers, per surface ---------------------------------------------------------------------


def messages_answer(body: dict, text: str, call: tuple[str, dict] | None) -> tuple[dict, list]:
    """An Anthropic message and its SSE events."""
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if call:
        block: dict[str, Any] = {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call[0],
            "input": call[1],
        }
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call[1])}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": text}
        delta = {"type": "text_delta", "text": text}
        stop = "end_turn"
    usage = {"input_tokens": 10, "output_tokens": 5}
    head = {"id": message_id, "type": "message", "role": "assistant", "model": body.get("model")}
    message = head | {"content": [block], "stop_reason": stop, "stop_sequence": None}
    empty = {**block, "input": {}} if call else {**block, "text": ""}
    events = [
        (
            "message_start",
            head
            | {"content": [], "stop_reason": None, "stop_sequence": None}
            | {"usage": {"input_tokens": 10, "output_tokens": 0}},
        ),
        ("content_block_start", {"index": 0, "content_block": empty}),
        ("content_block_delta", {"index": 0, "delta": delta}),
        ("content_block_stop", {"index": 0}),
        (
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 5}},
        ),
        ("message_stop", {}),
    ]
    sse = []
    for name, data in events:
        payload = {"type": name, **({"message": data} if name == "message_start" else data)}
        sse.append((name, payload))
    return message | {"usage": usage}, sse


def responses_answer(body: dict, text: str, call: tuple[str, dict] | None) -> tuple[dict, list]:
    """An OpenAI Responses response and its SSE events."""
    response_id = f"resp_{uuid.uuid4().hex[:24]}"
    if call:
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call[0],
            "arguments": json.dumps(call[1]),
            "status": "completed",
        }
    else:
        item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }
    base = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "output": [],
        "status": "in_progress",
    }
    done = base | {"status": "completed", "output": [item], "usage": usage}
    started = {**item, "status": "in_progress"}
    if not call:
        started["content"] = []
    events: list[tuple[str, dict]] = [
        ("response.created", {"response": base}),
        ("response.in_progress", {"response": base}),
        ("response.output_item.added", {"output_index": 0, "item": started}),
    ]
    if call:
        events.append(
            (
                "response.function_call_arguments.delta",
                {"output_index": 0, "item_id": item["id"], "delta": item["arguments"]},
            )
        )
        events.append(
            (
                "response.function_call_arguments.done",
                {"output_index": 0, "item_id": item["id"], "arguments": item["arguments"]},
            )
        )
    else:
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"output_index": 0, "item_id": item["id"], "content_index": 0}
        events += [
            ("response.content_part.added", where | {"part": part}),
            ("response.output_text.delta", where | {"delta": text}),
            ("response.output_text.done", where | {"text": text}),
            ("response.content_part.done", where | {"part": {**part, "text": text}}),
        ]
    events += [
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": done}),
    ]
    sse = [
        (name, {"type": name, "sequence_number": n, **data})
        for n, (name, data) in enumerate(events)
    ]
    return done, sse


def chat_answer(body: dict, text: str, call: tuple[str, dict] | None) -> tuple[dict, list]:
    """An OpenAI chat completion and its SSE chunks (unnamed events)."""
    chat_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    head = {"id": chat_id, "created": int(time.time()), "model": body.get("model")}
    if call:
        calls = [
            {
                "index": 0,
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call[0], "arguments": json.dumps(call[1])},
            }
        ]
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
        finish = "tool_calls"
        delta: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    else:
        message = {"role": "assistant", "content": text}
        finish = "stop"
        delta = {"role": "assistant", "content": text}
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    full = head | {
        "object": "chat.completion",
        "usage": usage,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }
    chunk = head | {"object": "chat.completion.chunk"}
    sse = [
        ("", chunk | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
        ("", chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
        ("", chunk | {"choices": [], "usage": usage}),
    ]
    return full, sse


ANSWERS = {"messages": messages_answer, "responses": responses_answer, "chat": chat_answer}
GENERATION_PATHS = {
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "chat": "/v1/chat/completions",
}


# ----- the server -------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """Records each request, answers it (``Capture`` says how)."""

    protocol_version = "HTTP/1.1"
    capture: Capture  # set on a subclass per server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _headers(self) -> dict[str, str]:
        return {
            k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
            for k, v in self.headers.items()
        }

    def _body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"<raw>": raw.decode("utf-8", "replace")[:2000]}

    def _json(self, status: int, body: Any, head_only: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if not head_only:
            self.wfile.write(data)

    def _probe(self, head_only: bool) -> None:
        path = self.path.split("?")[0]
        self.capture.record({"method": self.command, "path": self.path, "headers": self._headers()})
        if path.rstrip("/").endswith("/models"):
            listing = {"object": "list", "data": [{"id": "captured", "object": "model"}]}
            self._json(200, listing, head_only)
        else:
            self._json(200, {}, head_only)

    def do_HEAD(self) -> None:
        self._probe(head_only=True)

    def do_GET(self) -> None:
        self._probe(head_only=False)

    def do_POST(self) -> None:
        body = self._body()
        path = self.path.split("?")[0]
        self.capture.record(
            {"method": "POST", "path": self.path, "headers": self._headers(), "body": body}
        )
        if not isinstance(body, dict):
            self._json(400, {"error": "expected a JSON object"})
            return
        if path.endswith("/count_tokens"):
            self._json(200, {"input_tokens": 10})
            return
        if not path.endswith(GENERATION_PATHS[self.capture.surface]):
            self._json(404, {"error": f"not a {self.capture.surface} path: {path}"})
            return
        call = self.capture.scripted_call(body)
        full, events = ANSWERS[self.capture.surface](body, self.capture.text, call)
        if not body.get("stream"):
            self._json(200, full)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        for name, data in events:
            line = (f"event: {name}\n" if name else "") + f"data: {json.dumps(data)}\n\n"
            self.wfile.write(line.encode())
        if self.capture.surface == "chat":
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--surface", choices=sorted(ANSWERS), default="messages")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--log", required=True, help="JSON lines file, appended to")
    parser.add_argument("--text", default="Done.", help="the text of every plain answer")
    parser.add_argument("--tool", help="answer the first generation offering it with its call")
    parser.add_argument("--tool-input", default="{}", help="the call's input, a JSON object")
    parser.add_argument("--timeout", type=float, default=600, help="stop after this many s")
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), type("Bound", (Handler,), {"capture": Capture(args)})
    )
    timer = threading.Timer(args.timeout, server.shutdown)
    timer.daemon = True
    timer.start()
    print(f"capturing {args.surface} at http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
