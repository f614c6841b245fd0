"""A session's turns as a chat transcript: each turn shows only what is new in its prompt.

An agent resends its whole history with every call, so a turn whose messages begin with the
previous turn of its conversation's messages and reply shows just the messages after them; any
other turn (the first of a conversation, or the agent rewrote its history: a break) shows all of
its messages. Each turn says how it came (``kind``): it continues its row, starts a
conversation, retries its conversation's previous request, breaks the conversation's history,
or is another choice of the request above (n > 1), whose prompt it shares. Messages are shown
in chat's form (role, text content, tool calls): a surface whose turns record another form
converts them (``AS_SHOWN``, by the turn's surface). Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.rl.schemas import TurnOut
from server.store.rows import asks_the_same


@dataclass
class TranscriptTurn:
    turn: TurnOut
    messages: list[Any] = field(default_factory=list)  # what the prompt adds
    hidden: int = 0  # earlier messages not repeated
    same_request: bool = False  # another choice of the request above
    reply: dict = field(default_factory=dict)  # the turn's response, as shown
    kind: str = "continues"  # continues, conversation, retry, break, choice


def _kind(turn: TurnOut, previous: TurnOut | None) -> str:
    """How a request's first turn came, ``previous`` its conversation's previous request's."""
    if previous is None:
        return "conversation"
    if turn.extends_previous:
        return "continues"
    return "retry" if asks_the_same(turn, previous) else "break"


def transcript(turns: list[TurnOut]) -> list[TranscriptTurn]:
    out: list[TranscriptTurn] = []
    previous: TurnOut | None = None  # the turn above
    latest: dict[int, TurnOut] = {}  # conversation -> its previous request's first turn
    for turn in turns:
        reply = _reply(turn)
        if previous is not None and turn.request_id == previous.request_id:
            out.append(TranscriptTurn(turn, same_request=True, reply=reply, kind="choice"))
            continue
        before = latest.get(turn.conversation)
        kind = _kind(turn, before)
        messages = _shown(turn, turn.messages or [])
        seen = _history(before)
        if seen and [_key(m) for m in messages[: len(seen)]] == [_key(m) for m in seen]:
            shown = TranscriptTurn(turn, messages[len(seen) :], len(seen), reply=reply, kind=kind)
        else:
            shown = TranscriptTurn(turn, messages, reply=reply, kind=kind)
        out.append(shown)
        previous = latest[turn.conversation] = turn
    return out


def _history(turn: TurnOut | None) -> list[Any]:
    """The messages a continuation of ``turn`` starts with: its prompt, then its reply."""
    if turn is None or turn.messages is None:
        return []
    return [*_shown(turn, turn.messages), _reply(turn)]


def _shown(turn: TurnOut, messages: list[Any]) -> list[Any]:
    convert = AS_SHOWN.get(turn.surface)
    return [shown for m in messages for shown in convert(m)] if convert else list(messages)


def _reply(turn: TurnOut) -> dict:
    convert = AS_SHOWN.get(turn.surface)
    if convert is None or not isinstance(turn.response, dict):
        return turn.response if isinstance(turn.response, dict) else {}
    shown = convert(turn.response)
    return shown[-1] if shown else {}


def _anthropic(message: Any) -> list[Any]:
    """An Anthropic message (blocks or text) as chat messages: its text, its ``tool_use``
    blocks as tool calls, its ``tool_result`` blocks as tool messages before it."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return [message]
    out: list[Any] = []
    texts, calls = [], []
    for block in message["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            texts.append(f"(thinking) {block.get('thinking', '')}\n")
        elif kind == "tool_use":
            calls.append({"name": block.get("name"), "input": block.get("input")})
        elif kind == "tool_result":
            result = block.get("content")
            if isinstance(result, list):
                result = "".join(str(part.get("text", "")) for part in result)
            out.append({"role": "tool", "content": result})
        else:
            texts.append(f"[{kind} block]")
    if texts or calls or not out:
        shown: dict[str, Any] = {"role": message.get("role"), "content": "".join(texts)}
        if calls:
            shown["tool_calls"] = calls
        out.append(shown)
    return out


def _responses(item: Any) -> list[Any]:
    """A Responses API input item, or a whole Response (its output items as one assistant
    message), as chat messages: reasoning and text as text, function and custom tool calls as
    tool calls (a custom tool's raw input as its arguments), call outputs as tool messages."""
    if not isinstance(item, dict):
        return [item]
    if item.get("object") == "response":
        shown = [_responses(output)[0] for output in item.get("output") or []]
        calls = [call for message in shown for call in message.get("tool_calls", [])]
        reply: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(str(message.get("content") or "") for message in shown),
        }
        return [reply | ({"tool_calls": calls} if calls else {})]
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):  # a custom tool's call: its raw input
        arguments = item.get("arguments" if kind == "function_call" else "input")
        call = {"name": item.get("name"), "arguments": arguments}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind in ("function_call_output", "custom_tool_call_output"):
        return [{"role": "tool", "content": _item_text(item.get("output"))}]
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary")
        return [{"role": "assistant", "content": f"(thinking) {_item_text(parts)}\n"}]
    if kind != "message":
        return [{"role": "?", "content": f"[{kind} item]"}]
    return [{"role": item.get("role"), "content": _item_text(item.get("content"))}]


def _item_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


# How a surface's recorded messages are shown: one stored message to chat-form messages.
AS_SHOWN: dict[str, Callable[[Any], list[Any]]] = {"messages": _anthropic, "responses": _responses}


def _key(message: Any) -> tuple[Any, str]:
    """What identifies a message across resends (clients add or drop empty fields)."""
    if not isinstance(message, dict):
        return (None, str(message))
    return (message.get("role"), str(message.get("content") or ""))
