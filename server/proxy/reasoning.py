"""A reasoning model's answer, split into its reasoning and the answer proper.

Reasoning models (Qwen3, DeepSeek-R1) write ``<think>...</think>`` before the answer. The proxy
serves the block's inside as reasoning (``reasoning_content`` on chat, reasoning items on the
Responses API, ``thinking`` blocks on Anthropic Messages) and the rest as the content. Two views
of one rule: :func:`split_reasoning` reads a finished text, a :class:`ReasoningStream` is fed its
deltas and returns what can be sent now; however the text is chunked, the stream's reasoning
deltas join to the split's reasoning, and its content deltas to the split's content.

The rule: the reasoning is the text from a ``<think>`` that opens the answer (after whitespace
only) up to the first ``</think>``, or to the end when it never closes (the answer ran out of
tokens); newlines at its two ends are dropped. The content is what follows ``</think>``, its
leading whitespace dropped. When the model's generation prompt leaves a ``<think>`` open
(DeepSeek-R1 writes ``<think>\\n`` there), the answer starts inside the block. Text that opens
with no ``<think>`` is all content, as is, and has no reasoning (None). Only models whose chat
template speaks of ``<think>`` are read this way (:func:`reasoning_style`): for any other model
the text is all content.

This module knows nothing of tokens, tool calls, HTTP or SSE framing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from server.text.tokenization import TemplateError, Tokenizer

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    reads_reasoning: bool  # the template speaks of <think>: split answers
    starts_open: bool  # the generation prompt leaves <think> open: answers start inside


NO_REASONING = ReasoningStyle(False, False)


@lru_cache(maxsize=64)
def reasoning_style(tokenizer: Tokenizer) -> ReasoningStyle:
    """How the model of ``tokenizer`` writes reasoning, read off its chat template."""
    if OPEN not in tokenizer.chat_template:
        return NO_REASONING
    opening = generation_prompt(tokenizer)
    return ReasoningStyle(True, opening.rfind(OPEN) > opening.rfind(CLOSE))


@lru_cache(maxsize=64)
def generation_prompt(tokenizer: Tokenizer) -> str:
    """What the chat template writes before every answer (``<|im_start|>assistant\\n``); empty
    when it cannot be told."""
    probe = [{"role": "user", "content": "?"}]
    try:
        bare = tokenizer.render(probe, add_generation_prompt=False)
        opened = tokenizer.render(probe, add_generation_prompt=True)
    except TemplateError:
        return ""
    return opened[len(bare) :] if opened.startswith(bare) else ""


def split_reasoning(text: str, style: ReasoningStyle) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a finished answer (the rule in the module docstring)."""
    if not style.reads_reasoning:
        return None, text
    if style.starts_open:
        body = text
    elif text.lstrip().startswith(OPEN):
        body = text.lstrip()[len(OPEN) :]
    else:
        return None, text
    reasoning, closed, content = body.partition(CLOSE)
    return reasoning.strip("\n"), content.lstrip() if closed else ""


Part = tuple[Literal["reasoning", "content"], str]


class ReasoningStream:
    """Feed an answer's text deltas; get back ``("reasoning" | "content", text)`` parts that
    can be sent now (never empty). One stream per answer."""

    def __init__(self, style: ReasoningStyle) -> None:
        self._phase = "inside" if style.starts_open else "before"
        if not style.reads_reasoning:
            self._phase = "content"
        self._buffer = ""  # held: a possible start of <think> or </think>, trailing newlines
        self._started = False  # reasoning was sent (later leading newlines are kept)

    def feed(self, delta: str) -> list[Part]:
        self._buffer += delta
        parts: list[Part] = []
        if self._phase == "before":
            self._before()
        if self._phase == "inside":
            self._inside(parts)
        if self._phase == "after":
            stripped = self._buffer.lstrip()
            self._buffer = stripped
            if stripped:
                self._phase = "content"
        if self._phase == "content" and self._buffer:
            parts.append(("content", self._buffer))
            self._buffer = ""
        return parts

    def finish(self) -> list[Part]:
        """End of the answer: whatever is held, as the split would read it."""
        rest, self._buffer = self._buffer, ""
        if self._phase == "inside":
            text = rest.rstrip("\n") if self._started else rest.strip("\n")
            return [("reasoning", text)] if text else []
        if self._phase in ("before", "content") and rest:
            return [("content", rest)]
        return []

    def _before(self) -> None:
        """Until the text is clearly not a <think>, hold it; then go inside, or to content."""
        head = self._buffer.lstrip()
        if head.startswith(OPEN):
            self._buffer = head[len(OPEN) :]
            self._phase = "inside"
        elif not OPEN.startswith(head):
            self._phase = "content"

    def _inside(self, parts: list[Part]) -> None:
        reasoning, closed, rest = self._buffer.partition(CLOSE)
        if closed:
            self._buffer = rest
            self._phase = "after"
            self._send(reasoning.rstrip("\n"), parts)
            return
        held = _partial_length(reasoning, CLOSE)
        ready, self._buffer = reasoning[: len(reasoning) - held], reasoning[len(reasoning) - held :]
        sendable = ready.rstrip("\n")
        self._buffer = ready[len(sendable) :] + self._buffer
        self._send(sendable, parts)

    def _send(self, text: str, parts: list[Part]) -> None:
        if not self._started:
            text = text.lstrip("\n")
        if text:
            self._started = True
            parts.append(("reasoning", text))


def _partial_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
