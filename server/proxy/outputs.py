"""What every surface's answer is made of: a completion's final text, its streamed text (and
tool calls), its logprobs in OpenAI's shape, usage counts, and the envelope and stream framing
that chat and text completions share (``OpenAIRenderer``).

The text is always decoded by the proxy from the sampled token ids (never taken from the
engine), a matched stop string or stop token is cut from it, and while streaming, text that may
be the start of a stop string is held back until it is clear.
"""

from __future__ import annotations

from typing import Any

from server.errors import ProxrlError, body_of
from server.proxy.generation import Completion
from server.proxy.plan import Plan
from server.proxy.reasoning import NO_REASONING, ReasoningStream, reasoning_style
from server.proxy.tool_calls import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    ToolCallStream,
)
from server.text.detokenize import IncrementalDecoder
from server.text.stop_strings import held_back
from server.text.tokenization import Tokenizer


def final_text(tokenizer: Tokenizer, completion: Completion) -> str:
    ids = completion.ids
    matched = completion.finish_reason.get("matched")
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def finish_reason(completion: Completion, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if completion.finish_reason.get("type") == "length" else "stop"


class TextStreamer:
    """Streamed text of one completion: deltas safe to send, and the rest at the end."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._decoder = IncrementalDecoder(tokenizer.decode)
        self._stops = stops
        self._pending = ""

    def push(self, ids: list[int]) -> str:
        self._pending += self._decoder.push(ids)
        found = [self._pending.find(stop) for stop in self._stops if stop in self._pending]
        if found:  # a whole stop string: nothing from it on is ever sent
            ready = self._pending[: min(found)]
        else:
            ready = self._pending[: len(self._pending) - held_back(self._pending, self._stops)]
        self._pending = self._pending[len(ready) :]
        return ready

    def finish(self, completion: Completion) -> str:
        matched = completion.finish_reason.get("matched")
        rest = self._pending + self._decoder.flush()
        self._pending = ""
        if isinstance(matched, str) and matched in rest:
            rest = rest[: rest.find(matched)]
        return rest


class ChoiceText:
    """The streamed text of one choice, as the deltas that can be sent now: stop strings held
    back (``TextStreamer``); when ``reasoning`` is on (every surface but text completions), a
    reasoning model's ``<think>`` block split off as ``ReasoningDelta``s, all before the rest
    (``reasoning.ReasoningStream``; the model's chat template says whether it reasons); when
    ``tool_names`` is given, tool calls split out of the rest (``ToolCallStream``); the rest as
    ``ContentDelta``s. ``called``: a tool call was sent. A surface's renderer handles all three
    kinds of ``StreamEvent`` (Responses: a reasoning item; Anthropic: a ``thinking`` block).
    ``forced``, a forced call's start (``forced_calls``), is read for tool calls before the
    sampled text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: tuple[str, ...],
        tool_names: set[str] | None,
        reasoning: bool = False,
        forced: str = "",
    ) -> None:
        self._text = TextStreamer(tokenizer, stops)
        self._reasoning = ReasoningStream(reasoning_style(tokenizer) if reasoning else NO_REASONING)
        self._tools = ToolCallStream(tool_names) if tool_names is not None else None
        self._forced = forced  # read with the first content
        self.called = False

    def push(self, ids: list[int]) -> list[StreamEvent]:
        return self._deltas(self._text.push(ids), final=False)

    def finish(self, completion: Completion) -> list[StreamEvent]:
        return self._deltas(self._text.finish(completion), final=True)

    def _deltas(self, text: str, final: bool) -> list[StreamEvent]:
        parts = self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
        events: list[StreamEvent] = [ReasoningDelta(t) for kind, t in parts if kind == "reasoning"]
        content = "".join(t for kind, t in parts if kind == "content")
        if content or final:
            content, self._forced = self._forced + content, ""
        if self._tools is None:
            return events + ([ContentDelta(content)] if content else [])
        events += self._tools.feed(content) + (self._tools.finish() if final else [])
        self.called = self.called or any(isinstance(e, ToolCallDelta) for e in events)
        return events


def logprob_entry(
    tokenizer: Tokenizer, token: int, logprob: float, top: list[tuple[float, int]] | None
) -> dict:
    """One token of OpenAI's chat ``logprobs.content``."""
    text = tokenizer.token_text(token)
    entry: dict = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    entry["top_logprobs"] = [
        {"token": t, "logprob": lp, "bytes": list(t.encode())}
        for lp, t in ((lp, tokenizer.token_text(tid)) for lp, tid in (top or []))
    ]
    return entry


def usage(prompt_tokens: int, completions: list[Completion]) -> dict:
    completion_tokens = sum(len(c.ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIRenderer:
    """What chat and text completions' answers share: the envelope (``id``, ``object``,
    ``created``, ``model``), chunks with the same head, the usage chunk (when asked for),
    errors in OpenAI's shape and ``[DONE]``. A surface adds its choices (``answer.Renderer``)."""

    named_events = False
    object = ""  # the answer's ``object``
    chunk_object = ""  # a streamed chunk's ``object``

    def __init__(self, model: str, plan: Plan, include_usage: bool) -> None:
        self.model, self.plan, self.include_usage = model, plan, include_usage

    def envelope(self, choices: list[dict], usage: dict) -> dict:
        return {
            "id": self.plan.request_id,
            "object": self.object,
            "created": self.plan.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def chunk(self, choices: list[dict], **extra: Any) -> dict:
        head = {
            "id": self.plan.request_id,
            "object": self.chunk_object,
            "created": self.plan.created,
            "model": self.model,
        }
        return {**head, "choices": choices, **extra}

    def end(self, usage: dict) -> list[dict]:
        return [self.chunk([], usage=usage)] if self.include_usage else []

    @staticmethod
    def error(error: ProxrlError) -> list[dict]:
        return [body_of(error)]

    @staticmethod
    def closing() -> list[str]:
        return ["[DONE]"]
