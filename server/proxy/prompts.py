"""Prompt token ids for a turn, continuing the session's last turn token for token when it can.

The agent sends back, as history, text the model generated. Re-tokenizing that text could give
other tokens than the ones sampled, which would break the training row. So when the rendered
prompt begins with the text of a previous turn (its prompt + completion), the prompt is built
as that turn's exact token ids followed by the tokens of the new text only. Otherwise it is
tokenized from scratch, and the turn starts a new row.

"Begins with the text of a previous turn" allows for what the agent never saw or what the chat
template drops when it renders history (the splice rule, :func:`aligned_end`):

- **special tokens** (those decoding leaves out: an ``<|endoftext|>`` that ended an answer, an
  ``<|im_start|>`` sampled inside one) may be missing from the rendered text;
- **reasoning**: a ``<think>...</think>`` block (through the end of the turn when it never
  closed, as when the answer ran out of tokens), with the whitespace after it, may be missing.
  Reasoning models' templates (Qwen3, DeepSeek-R1) render earlier assistant turns without it.
  The block may open in the template's generation prompt (DeepSeek-R1 writes ``<think>\\n``
  there) and close in the completion. Where the rendered text holds a ``<think>`` block in its
  place (the agent sent the reasoning back), it must be the block as sampled.

Everything else must match character for character: a break only ever means that the agent
changed its history. The spliced prompt keeps the exact earlier tokens, thinking and special
tokens included, so it extends the previous prompt + completion token for token and the row
goes on. The proxy's own tool-call rendering is not allowed for: a tool call the template
re-renders differently from how the model wrote it (other JSON spacing) still breaks the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from server.proxy.session_cache import LastTurn
from server.text.tokenization import Tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    continues: LastTurn | None  # the turn this prompt extends token for token, if any


class Kind(Enum):
    TEXT = "text"  # must be in the rendered text as is
    SPECIAL = "special"  # a special token's text: may be missing
    OPEN = "open"  # <think>: with its block, up to the matching </think>, may be missing
    CLOSE = "close"  # </think>


@dataclass(frozen=True)
class Unit:
    """A piece of a turn's text as the splice rule reads it."""

    text: str
    kind: Kind


def splice(tokenizer: Tokenizer, text: str, last: list[LastTurn]) -> Prompt:
    """Token ids of the prompt ``text``, reusing the tokens of the turn it extends."""
    for turn in last:
        end = len(turn.text) if text.startswith(turn.text) else None
        if end is None:
            end = aligned_end(units_of(tokenizer, turn.prompt_ids + turn.completion_ids), text)
        if end is not None and end < len(text):
            suffix = tokenizer.encode(text[end:])
            return Prompt(turn.prompt_ids + turn.completion_ids + suffix, turn)
    return Prompt(tokenizer.encode(text), None)


def from_ids(ids: list[int], last: list[LastTurn]) -> Prompt:
    """A prompt given as token ids: it extends a turn when it starts with that turn's tokens."""
    for turn in last:
        prefix = turn.prompt_ids + turn.completion_ids
        if len(ids) > len(prefix) and ids[: len(prefix)] == prefix:
            return Prompt(ids, turn)
    return Prompt(ids, None)


def aligned_end(units: Sequence[Unit], text: str) -> int | None:
    """Where in ``text`` the turn made of ``units`` ends, reading it by the splice rule (module
    docstring): None when ``text`` does not begin with the turn. An optional part that ``text``
    holds is first taken as present; when the rest then fails to match, as absent."""
    choices: list[State] = [(0, 0, False)]
    tried: set[State] = set()
    while choices:
        state = choices.pop()
        if state not in tried:
            tried.add(state)
            end = _follow(units, text, state, choices)
            if end is not None:
                return end
    return None


State = tuple[int, int, bool]  # the next unit, the place in the text, after dropped reasoning


def _follow(units: Sequence[Unit], text: str, state: State, choices: list[State]) -> int | None:
    """Match ``units`` from ``state`` on, taking optional parts as present where ``text`` holds
    them (and noting the other way in ``choices``); the end in ``text``, or None."""
    index, pos, after_drop = state
    while index < len(units):
        unit = units[index]
        index += 1
        if after_drop:  # the whitespace after dropped reasoning, on either side
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        if unit.kind is Kind.TEXT:
            piece = unit.text.lstrip() if after_drop else unit.text
            if not text.startswith(piece, pos):
                return None
            pos, after_drop = pos + len(piece), after_drop and not piece
            continue
        present = text.startswith(unit.text, pos)
        if unit.kind is Kind.CLOSE and not present:
            return None
        absent: State | None = (index, pos, after_drop)
        if unit.kind is Kind.OPEN:  # reasoning the text holds, edited, is no dropped block
            edited = text[pos:].lstrip().startswith(THINK_OPEN)
            absent = None if edited else (_block_end(units, index), pos, True)
        if not present:
            if absent is None:
                return None
            index, pos, after_drop = absent
            continue
        if unit.kind is not Kind.CLOSE and absent is not None:
            choices.append(absent)
        pos, after_drop = pos + len(unit.text), False
    return pos


def _block_end(units: Sequence[Unit], index: int) -> int:
    """The index after the ``</think>`` that closes a block whose body starts at ``index`` (the
    end of the units when it never closes)."""
    for at in range(index, len(units)):
        if units[at].kind is Kind.CLOSE:
            return at + 1
    return len(units)


def units_of(tokenizer: Tokenizer, ids: Sequence[int]) -> list[Unit]:
    """The text of ``ids`` as units: special tokens apart, each run of other tokens decoded
    together and cut at its ``<think>``/``</think>`` markers."""
    units: list[Unit] = []
    run: list[int] = []
    for token in ids:
        if _is_special(tokenizer, token):
            units += _text_units(tokenizer.decode(run, skip_special_tokens=False))
            units.append(Unit(tokenizer.token_text(token), Kind.SPECIAL))
            run = []
        else:
            run.append(token)
    return units + _text_units(tokenizer.decode(run, skip_special_tokens=False))


def _text_units(text: str) -> list[Unit]:
    units = []
    while text:
        marks = [(text.find(m), m) for m in (THINK_OPEN, THINK_CLOSE) if m in text]
        if not marks:
            units.append(Unit(text, Kind.TEXT))
            break
        at, mark = min(marks)
        if at:
            units.append(Unit(text[:at], Kind.TEXT))
        units.append(Unit(mark, Kind.OPEN if mark == THINK_OPEN else Kind.CLOSE))
        text = text[at + len(mark) :]
    return units


@lru_cache(maxsize=65536)
def _is_special(tokenizer: Tokenizer, token: int) -> bool:
    """A token that decoding leaves out (what a client is served never holds it)."""
    return tokenizer.decode([token]) == "" and tokenizer.token_text(token) != ""
