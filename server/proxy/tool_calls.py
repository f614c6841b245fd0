"""Tool calls in model text: Hermes/Qwen2.5 ``<tool_call>{json}</tool_call>`` blocks to OpenAI.

Two views of one set of rules: :func:`parse_tool_calls` reads a finished completion, and a
:class:`ToolCallStream` is fed a completion's text deltas as they are generated and returns what
can be sent now. For any text, however it is chunked, the stream yields the same calls (names
and arguments, in order) and the same content as the parse.

The rules:

- A block opens at ``<tool_call>`` and closes at the *first* ``</tool_call>`` after it; inside
  an open block ``<tool_call>`` is plain text. So a JSON string value holding the literal
  ``</tool_call>`` cuts its block short, the cut body is not JSON, and the block stays content.
- A closed block is a call when its body is a JSON object with a non-empty string ``"name"``
  and ``"arguments"`` that is an object, a string holding a JSON object, or absent (``{}``),
  and, when ``tool_names`` is given, the name is one of them. NaN and Infinity are refused,
  and so is a number past a double's range (an OpenAI client cannot read them). A call's
  ``arguments`` is the object re-dumped with ``ensure_ascii=False``.
- A free-form tool (``ToolNames.free_form``: the Responses API's ``custom`` tools) is called
  with exactly one argument, ``"input"``, a string: its raw text (``free_form_input``). A call
  to one with any other arguments is not a call.
- Anything else stays in the content verbatim, markup included: a block that is not a call, a
  block never closed (the model ran out of tokens), a stray ``</tool_call>``.
- Content is the text outside call blocks, joined as is, with leading and trailing whitespace
  stripped; whitespace between pieces (say, text on both sides of a call) is kept. ``None``
  when that is empty and there are calls, as OpenAI returns it.

The stream sends ordinary text as soon as it cannot be the start of ``<tool_call>``: it holds
back a trailing prefix of the marker ("<", "<tool_c"), every open block until it closes, and
trailing whitespace until non-whitespace content follows, so the newline before a call is never
sent and the concatenated deltas equal the parse's content exactly. Leading whitespace is never
sent; whatever is held at :meth:`ToolCallStream.finish` is flushed, bar trailing whitespace.

This module knows nothing of tokens, chat templates, HTTP or SSE framing, and does not check
arguments against the tools' JSON schemas. Call ids are fresh random ids: a stream and a parse
of the same text give the same calls under different ids.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLOSE",
    "OPEN",
    "ContentDelta",
    "ParsedOutput",
    "ReasoningDelta",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolNames",
    "free_form_arguments",
    "free_form_input",
    "is_call",
    "new_call_id",
    "parse_tool_calls",
    "same_call",
]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FREE_FORM_ARGUMENT = "input"  # a free-form tool's one argument: its raw text


class ToolNames(set[str]):
    """The names of the tools offered, where some are free-form (``free_form``): those take
    raw text, which the model passes as the one string argument ``"input"``. A plain set of
    names is a ``ToolNames`` with none free-form."""

    def __init__(self, names: Iterable[str] = (), free_form: Iterable[str] = ()) -> None:
        super().__init__(names)
        self.free_form = frozenset(free_form)


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex characters
    name: str
    arguments: str  # JSON text of the arguments object

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry; ``index`` is given for streamed deltas."""
        head: dict[str, Any] = {} if index is None else {"index": index}
        function = {"name": self.name, "arguments": self.arguments}
        return head | {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there are calls and no other text
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    call: ToolCall
    index: int  # 0, 1, 2... in the order of calls in this completion


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning (the inside of ``<think>...</think>``, see
    ``server.proxy.reasoning``), streamed before the content. Chat sends it as
    ``delta.reasoning_content``; the Responses API as a reasoning item's text, Anthropic Messages
    as a ``thinking`` block's ``thinking_delta``. Only reasoning models' answers have any."""

    text: str


# What a choice's stream yields (``outputs.ChoiceText``): every surface's renderer handles all
# three kinds; reasoning deltas all come before the first content or tool-call delta.
StreamEvent = ContentDelta | ToolCallDelta | ReasoningDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: no double holds it, and Infinity is no JSON
        raise ValueError(f"{text} is past a double's range")
    return value


def _call_from_body(body: str, tool_names: set[str] | None) -> ToolCall | None:
    """The call a block's body describes, or None when the block is not a call."""
    try:
        payload = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
        if not isinstance(payload, dict):
            return None
        name = payload.get("name")
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(
                arguments, parse_constant=_refuse_constant, parse_float=_finite_float
            )
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    if tool_names is not None and name not in tool_names:
        return None
    free_form = isinstance(tool_names, ToolNames) and name in tool_names.free_form
    if free_form and not _is_free_form(arguments):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def is_call(body: str) -> bool:
    """Whether a block's body is a call to some tool (whichever tools were offered)."""
    return _call_from_body(body, None) is not None


def same_call(sampled: str, rendered: str) -> bool:
    """Whether two block bodies are the same call, written differently: the same name and the
    same arguments as JSON values (spacing, key order, escapes and whether ``arguments`` is an
    object or a string holding one may differ). This is how a call the model wrote comes back
    when a client re-serializes its arguments and the chat template renders them again."""
    first, second = _call_from_body(sampled, None), _call_from_body(rendered, None)
    if first is None or second is None or first.name != second.name:
        return False
    return _same_value(json.loads(first.arguments), json.loads(second.arguments))


def _same_value(a: Any, b: Any) -> bool:
    """JSON values equal as a JSON reader sees them: numbers as numbers (``1.0`` is ``1``, as a
    JavaScript client re-serializes it, and an integer past a double's precision is the double
    it reads as), but ``true`` is not ``1``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        if isinstance(b, bool):
            return False
        try:
            return a == b or float(a) == float(b)
        except OverflowError:  # an integer no double holds: only itself is the same
            return False
    return type(a) is type(b) and a == b


def _is_free_form(arguments: dict[str, Any]) -> bool:
    return list(arguments) == [FREE_FORM_ARGUMENT] and isinstance(
        arguments[FREE_FORM_ARGUMENT], str
    )


def free_form_arguments(text: str) -> str:
    """The ``arguments`` of a call to a free-form tool with raw text ``text``: what the
    model writes, and what a call sent back in a conversation renders as."""
    return json.dumps({FREE_FORM_ARGUMENT: text}, ensure_ascii=False)


def free_form_input(call: ToolCall) -> str:
    """The raw text of a call to a free-form tool (a call this module parsed)."""
    text = json.loads(call.arguments)[FREE_FORM_ARGUMENT]
    assert isinstance(text, str)
    return text


def parse_tool_calls(text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """Split a finished completion into content and tool calls (rules in the module docstring)."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        after = end + len(CLOSE)
        call = _call_from_body(text[start + len(OPEN) : end], tool_names)
        if call is None:
            pieces.append(text[pos:after])
        else:
            pieces.append(text[pos:start])
            calls.append(call)
        pos = after
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    return ParsedOutput(content=content or (None if calls else ""), tool_calls=calls)


def malformed_blocks(text: str, tool_names: set[str] | None = None) -> int:
    """How many ``<tool_call>`` blocks of a finished completion are not calls (bad JSON, no name,
    a tool not offered, or a block never closed): they stay text, and the proxy counts them."""
    count, pos = 0, 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            return count + 1
        count += _call_from_body(text[start + len(OPEN) : end], tool_names) is None
        pos = end + len(CLOSE)
    return count


def _partial_open_length(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:length]):
            return length
    return 0


class ToolCallStream:
    """Feed text deltas as they are generated; get back what can be sent now.

    One stream per completion. Events come in text order; content deltas are never empty.
    """

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # received, not yet decided: a marker prefix or an open block's body
        self._in_block = False
        self._held_space = ""  # trailing content whitespace, sent only if content follows
        self._sent_content = False  # until then, whitespace is leading and dropped
        self._calls = 0

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        events: list[StreamEvent] = []
        while self._advance(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        """End of generation: flush everything held back, bar trailing whitespace."""
        leftover = OPEN + self._buffer if self._in_block else self._buffer
        self._buffer, self._in_block = "", False
        events: list[StreamEvent] = []
        self._content(leftover, events)
        self._held_space = ""
        return events

    def _advance(self, events: list[StreamEvent]) -> bool:
        """Act on the buffer once; False when it must wait for more text."""
        if self._in_block:
            end = self._buffer.find(CLOSE)
            if end == -1:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
            self._in_block = False
            self._close_block(body, events)
            return True
        start = self._buffer.find(OPEN)
        if start == -1:
            undecided = len(self._buffer) - _partial_open_length(self._buffer)
            self._content(self._buffer[:undecided], events)
            self._buffer = self._buffer[undecided:]
            return False
        self._content(self._buffer[:start], events)
        self._buffer = self._buffer[start + len(OPEN) :]
        self._in_block = True
        return True

    def _close_block(self, body: str, events: list[StreamEvent]) -> None:
        call = _call_from_body(body, self._tool_names)
        if call is None:
            self._content(OPEN + body + CLOSE, events)
            return
        events.append(ToolCallDelta(call, self._calls))
        self._calls += 1

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        """Send content, holding back trailing whitespace and dropping leading whitespace."""
        text = self._held_space + text
        if not self._sent_content:
            text = text.lstrip()
        sendable = text.rstrip()
        self._held_space = text[len(sendable) :]
        if sendable:
            self._sent_content = True
            events.append(ContentDelta(sendable))
