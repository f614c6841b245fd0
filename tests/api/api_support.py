"""What the in-process API tests share: the app's client with keys (``Api``), OpenAI-shaped
error checks, SSE parsing. The fixtures are in ``conftest.py``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
from anthropic import Anthropic
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk

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

    def session_of_run(self, config: dict | None = None, *, patch: bool = True, **fields) -> dict:
        """A session, made with the run's key, of a fresh run whose ``config`` is set as users set
        it: by ``PATCH /rl/runs/{id}`` (``patch``) or when the run is created; the run must echo
        each value. None: the run's defaults, nothing sent."""
        run = shown = self.new_run() if patch else self.new_run(**(config or {}))
        if patch and config is not None:
            shown = self.ok("PATCH", f"/rl/runs/{run['id']}", json={"config": config})
        for name, value in (config or {}).items():
            assert shown["config"][name] == value, shown["config"]
        return self.new_session(run["id"], key=run["api_key"], **fields)

    def session(self, session_id: str) -> dict:
        return self.ok("GET", f"/rl/sessions/{session_id}")

    def chat(self, session: dict, text: str = "hi", **body) -> dict:
        """One non-streamed chat turn with the session's key; the completion."""
        request = {"model": "tiny", "messages": [{"role": "user", "content": text}], **body}
        request.setdefault("max_tokens", 4)
        return self.ok("POST", "/v1/chat/completions", key=session["api_key"], json=request)

    def openai(self, key: str) -> OpenAI:
        """The OpenAI SDK over the in-process app with ``key``; no retries. Not to be closed: its
        HTTP client is the app's TestClient."""
        return OpenAI(
            base_url=f"{self.http.base_url}/v1", api_key=key, http_client=self.http, max_retries=0
        )

    def anthropic(self, key: str) -> Anthropic:
        """The Anthropic SDK over the in-process app with ``key``; no retries (as ``openai``)."""
        return Anthropic(
            base_url=str(self.http.base_url), api_key=key, http_client=self.http, max_retries=0
        )


def assert_error(reply: httpx.Response, status: int, *, code: str | None = None) -> dict:
    """An OpenAI-shaped error with ``status``; returns its ``error`` object."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def streamed_chat(chunks: list[ChatCompletionChunk]) -> tuple[str, list[float]]:
    """The content and the logprobs of the sampled tokens that a streamed chat completion's
    ``chunks`` (the SDK's) served for its first choice."""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [
        entry.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content or []
    ]
    return content, logprobs


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


def app_settings(model_dir: Path, engine_url: str, data_dir: Path, **extra):
    """The settings of an in-process app on ``model_dir`` served by the engine at
    ``engine_url``, with the tier's admin key and quiet logs; ``extra``: the test's own."""
    from server.settings import ServerSettings

    return ServerSettings(
        model=str(model_dir),
        engines=engine_url,
        data_dir=data_dir,
        admin_key=ADMIN_KEY,
        log_level="warning",
        **extra,
    )
