"""What the in-process API tests share: the app's client with keys (``Api``), OpenAI-shaped
error checks, SSE parsing. The fixtures are in ``conftest.py``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

ADMIN_KEY = "api-tier-admin-key"
NO_KEY = None


@dataclass
class Api:
    """The proxy app in this process: ``http`` is its TestClient; calls carry a key of the
    caller's choosing (the admin key unless told)."""

    http: TestClient
    model_dir: Path

    def call(self, method: str, path: str, key: str | None = ADMIN_KEY, **kwargs) -> httpx.Response:
        """One request; ``key`` goes in ``Authorization: Bearer`` (None: no header)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kwargs.pop("headers", {}))
        return self.http.request(method, path, headers=headers, **kwargs)

    def ok(self, method: str, path: str, status: int = 200, **kwargs) -> dict:
        """The JSON of a call that must answer ``status``."""
        reply = self.call(method, path, **kwargs)
        assert reply.status_code == status, reply.text
        return reply.json()

    def new_run(self, **config) -> dict:
        """A fresh run with ``config``; the answer carries its api_key."""
        return self.ok("POST", "/rl/runs", 201, json={"name": "api-test", "config": config})

    def new_session(self, run_id: str | None = None, key: str = ADMIN_KEY, **fields) -> dict:
        body = {"run_id": run_id, **fields} if run_id else fields
        return self.ok("POST", "/rl/sessions", 201, key=key, json=body)

    def session(self, session_id: str) -> dict:
        return self.ok("GET", f"/rl/sessions/{session_id}")

    def chat(self, session: dict, text: str = "hi", **body) -> dict:
        """One non-streamed chat turn with the session's key; the completion."""
        request = {"model": "tiny", "messages": [{"role": "user", "content": text}], **body}
        request.setdefault("max_tokens", 4)
        return self.ok("POST", "/v1/chat/completions", key=session["api_key"], json=request)


def assert_error(reply: httpx.Response, status: int, *, code: str | None = None) -> dict:
    """An OpenAI-shaped error with ``status``; returns its ``error`` object."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_events(reply: httpx.Response) -> list[dict | str]:
    """The events of an SSE answer, each block checked to be one ``data:`` line: parsed JSON, or
    the string ``[DONE]``."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    events: list[dict | str] = []
    for block in reply.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
