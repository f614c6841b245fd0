"""Schemathesis hooks for test_api_fuzz.py: keep generated requests cheap, never less strict.

Loaded by the ``schemathesis run`` that test starts (``SCHEMATHESIS_HOOKS``). Each hook only
shrinks a value the schema already allows, so what is sent stays as valid (or as invalid) as
what was generated:

- a generation asks for at most ``MAX_TOKENS`` tokens: the schema bounds max_tokens by 2**31-1
  and the server by the context (2048 for the tiny model), but decoding 2048 tokens 16 times per
  request on two CPU cores would spend the whole run in the engine;
- a run waits at most ``MAX_ADMISSION_WAIT_S`` for admission: a generated run with batch_size 1
  admits two sessions, and every further POST /rl/sessions would wait its admission_wait_s (up to
  ten years by the schema) before its 429.

And so that generations reach the engine at all, a generation body names the served model
(``PROXRL_FUZZ_MODEL``) and loses the sampling settings the proxy refuses for what they would do
to training (top_p < 1, penalties, logit_bias, constrained formats, and the like): random values
for them would otherwise refuse nearly every generated body with a 400. A ``tool_choice`` that
forces a call (``required``, Anthropic's ``any``, a named tool) is served, its call started in the
prompt (server/proxy/forced_calls.py), so it is sent as generated; one that names a tool names the
body's first tool of its kind, where the body has one, so that forced named calls reach the engine
too (a name not among the tools is a 400, which the document gives every generation). Schemathesis
re-validates an edited case, so one the edit makes schema-valid counts as positive.

A cookie's generated value is sent as it would be read back: each character a Cookie header
cannot carry in a value (anything outside RFC 6265's cookie-octets: ``;`` ends the cookie, spaces
and a leading quote are stripped, non-ASCII is not sent) becomes ``_``, keeping its length. The
document bounds the dashboard cookie by its length only, so the value stays as valid or as
invalid as generated; left as generated, ``proxrl_admin=d^~%^wdKx;*???...`` (4104 characters)
is a 9-character cookie and one with no name, which the server reads as such, and schemathesis
counted its 200 an over-long cookie accepted.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

MAX_TOKENS = 4
MAX_ADMISSION_WAIT_S = 0.5
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
# RFC 6265 4.1.1: the characters a cookie's value may hold (no space, '"', ',', ';' or '\\').
COOKIE_OCTETS = frozenset(chr(c) for c in range(0x21, 0x7F)) - set('",;\\')
UNTRAINABLE = (
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "suffix",
    "best_of",
)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cap_tokens(body: dict[str, Any]) -> None:
    given = [field for field in TOKEN_FIELDS if field in body]
    if not given:
        body["max_tokens"] = MAX_TOKENS
    for field in given:
        if _is_count(body[field]) and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS


def _trainable(body: dict[str, Any]) -> None:
    if isinstance(body.get("model"), str):
        body["model"] = os.environ.get("PROXRL_FUZZ_MODEL", body["model"])
    if body.get("top_p") not in (None, 1):
        del body["top_p"]
    for field in UNTRAINABLE:
        body.pop(field, None)
    _name_a_tool(body, _chat_tool_name)
    if body.get("top_logprobs") and body.get("logprobs") is not True:
        del body["top_logprobs"]
    if body.get("echo") and body.get("logprobs") is not None:
        del body["echo"]


def _responses_trainable(body: dict[str, Any]) -> None:
    """The Responses API's body: the served model, at most MAX_TOKENS tokens, a named tool
    choice naming a tool of its kind, and none of what it refuses for training (top_p < 1,
    structured output, stored prompts, conversations, background mode)."""
    if isinstance(body.get("model"), str):
        body["model"] = os.environ.get("PROXRL_FUZZ_MODEL", body["model"])
    limit = body.setdefault("max_output_tokens", MAX_TOKENS)
    if _is_count(limit) and limit > MAX_TOKENS:
        body["max_output_tokens"] = MAX_TOKENS
    if body.get("top_p") not in (None, 1):
        del body["top_p"]
    _name_a_tool(body, _responses_tool_name)
    for field in ("text", "prompt", "conversation", "background"):
        body.pop(field, None)


def _messages_trainable(body: dict[str, Any]) -> None:
    """Anthropic's Messages body: the served model, at most MAX_TOKENS tokens, a named tool
    choice naming a tool the prompt shows, and none of what it refuses for training (top_p < 1,
    top_k)."""
    if isinstance(body.get("model"), str):
        body["model"] = os.environ.get("PROXRL_FUZZ_MODEL", body["model"])
    limit = body.get("max_tokens")
    if _is_count(limit) and limit > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS
    if body.get("top_p") not in (None, 1):
        del body["top_p"]
    body.pop("top_k", None)
    _name_a_tool(body, _messages_tool_name)


def _name_a_tool(body: dict[str, Any], name_of: Any) -> None:
    """Point a tool_choice that names a tool at the body's first tool it may name
    (``name_of(choice, tool)``: the tool's name, or None when the choice cannot name it), where
    there is one; every other choice is sent as generated."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not isinstance(choice, dict) or not isinstance(tools, list):
        return
    for tool in tools:
        name = name_of(choice, tool) if isinstance(tool, dict) else None
        if isinstance(name, str):
            if isinstance(choice.get("function"), dict):  # Chat Completions' shape
                choice["function"]["name"] = name
            else:
                choice["name"] = name
            return


def _chat_tool_name(choice: dict[str, Any], tool: dict[str, Any]) -> Any:
    function = tool.get("function")
    named = choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    return function.get("name") if named and isinstance(function, dict) else None


def _responses_tool_name(choice: dict[str, Any], tool: dict[str, Any]) -> Any:
    named = choice.get("type") in ("function", "custom") and tool.get("type") == choice["type"]
    return tool.get("name") if named else None


def _messages_tool_name(choice: dict[str, Any], tool: dict[str, Any]) -> Any:
    named = choice.get("type") == "tool" and not tool.get("defer_loading")
    return tool.get("name") if named else None


def _cap_admission_wait(config: dict[str, Any]) -> None:
    wait = config.get("admission_wait_s")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > MAX_ADMISSION_WAIT_S:
        config["admission_wait_s"] = MAX_ADMISSION_WAIT_S


def _cookie_value(value: Any) -> Any:
    """``value`` as a Cookie header carries it: every character that is not a cookie-octet
    replaced by ``_``, so its length (what the document bounds) is what the server reads."""
    if not isinstance(value, str):
        return value
    return "".join(char if char in COOKIE_OCTETS else "_" for char in value)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if case.cookies:
        case.cookies = {name: _cookie_value(value) for name, value in case.cookies.items()}
    body, path = case.body, case.operation.path
    if not isinstance(body, dict):
        return
    if path.endswith("/completions"):
        _trainable(body)
        _cap_tokens(body)
    elif path.endswith("/v1/responses"):
        _responses_trainable(body)
    elif path.endswith("/v1/messages"):
        _messages_trainable(body)
    elif path.startswith("/rl/runs") and isinstance(body.get("config"), dict):
        _cap_admission_wait(body["config"])
