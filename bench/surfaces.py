"""The API surfaces ``bench/proxy.py`` sends the same chat through: Chat Completions, the
Responses API and Anthropic Messages, each as a path under the session's base URL, a request
body, headers, and where its answer (or its stream's events) says how many tokens were sampled.

The conversation is always a system text and one user message; every surface renders it into
the same prompt ids (``bench/proxy.py`` checks them against the store). Only Chat Completions
takes a ``seed``; the other two have none, so their samples (and lengths) differ from the
direct side's. Knows nothing of timing or of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class Surface:
    path: str  # under the session's base_url (which ends in /v1)
    body: Callable[[str, list[dict[str, str]], int, float, int, bool], dict[str, Any]]
    tokens: Callable[[dict[str, Any]], int | None]  # from an answer or a stream event's data
    anthropic: bool = False  # Anthropic's headers: x-api-key and anthropic-version

    def headers(self, key: str) -> dict[str, str]:
        if self.anthropic:
            return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}
        return {"Authorization": f"Bearer {key}"}


def _system_and_user(messages: list[dict[str, str]]) -> tuple[str, str]:
    (system,) = [m["content"] for m in messages if m["role"] == "system"]
    (user,) = [m["content"] for m in messages if m["role"] == "user"]
    return system, user


def _chat(model, messages, max_tokens, temperature, seed, stream) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    body |= {"temperature": temperature, "seed": seed}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _chat_tokens(data: dict[str, Any]) -> int | None:
    usage = data.get("usage")
    return usage["completion_tokens"] if usage else None


def _responses(model, messages, max_tokens, temperature, seed, stream) -> dict[str, Any]:
    system, user = _system_and_user(messages)
    return {
        "model": model,
        "instructions": system,
        "input": user,
        "max_output_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }


def _responses_tokens(data: dict[str, Any]) -> int | None:
    # The stream's response.* events carry the response; its usage is set on the last one
    # (response.completed, or response.incomplete when max_output_tokens stopped it).
    data = data.get("response", data)
    usage = data.get("usage") if data.get("object") == "response" else None
    return usage["output_tokens"] if usage else None


def _messages(model, messages, max_tokens, temperature, seed, stream) -> dict[str, Any]:
    system, user = _system_and_user(messages)
    return {
        "model": model,
        "system": system,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }


def _messages_tokens(data: dict[str, Any]) -> int | None:
    if data.get("type") in ("message", "message_delta"):  # the answer, or the stream's end
        return data["usage"]["output_tokens"]
    return None


SURFACES = {
    "chat": Surface("/chat/completions", _chat, _chat_tokens),
    "responses": Surface("/responses", _responses, _responses_tokens),
    "messages": Surface("/messages", _messages, _messages_tokens, anthropic=True),
}
