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
  there) and close in the completion. So may text before a ``</think>`` that is in no block:
  those templates keep only what follows an answer's last ``</think>``. Where the rendered
  text holds a ``<think>`` block in its place (the agent sent the reasoning back), it must be
  the block as sampled, bar the whitespace around its inside and after it (templates re-render
  ``<think>\\n`` + reasoning + ``\\n</think>\\n\\n``);
- **whitespace** at the start of an answer (after the template's generation prompt) and after
  dropped reasoning may differ (Qwen3's template strips an answer's leading newlines);
- **tool calls**: a ``<tool_call>`` block the model wrote that is a call may come back
  written differently: the client re-serialized its arguments (Qwen Code sends them compact,
  Claude Code as an object the template dumps again) and the template rendered the call its
  own way. The rendered block must be the same call: the same name and the same arguments as
  JSON values (``tool_calls.same_call``); spacing, key order and escapes may differ. A block
  that was not a call went back to the client as text and must come back as it was.

Everything else must match character for character, and where an answer's end token is
missing the history must go on with an answer's end (an eos text): an answer edited or extended
is a break. (A ``</think>`` with no ``<think>`` before it may also be missing.)
The spliced prompt keeps the exact earlier tokens, thinking and special
tokens included, so it extends the previous prompt + completion token for token and the row
goes on. The new text is tokenized as the whole prompt would be: a special token's text that
the client wrote stays text (``PromptText.as_text``), whatever turn it falls in.

Rendering and tokenizing a long prompt takes long (seconds for megabytes), so the surfaces run
them on a few worker threads (:func:`off_loop`), never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from functools import cache, lru_cache
from typing import TypeVar

from server.proxy.reasoning import generation_prompt
from server.proxy.session_cache import LastTurn
from server.proxy.tool_calls import CLOSE as CALL_CLOSE
from server.proxy.tool_calls import OPEN as CALL_OPEN
from server.proxy.tool_calls import is_call, same_call
from server.text.tokenization import PromptText, Tokenizer, TooManyTokens

T = TypeVar("T")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Readings of a turn tried before it counts as not continued (each costs a pass over the turn):
# a history that really changed fails at its first few, so this only bounds pathological input.
MAX_READINGS = 256
# Threads that render and tokenize prompts: requests beyond them wait their turn, the event loop
# and every other request go on.
PROMPT_THREADS = 4
# A request whose body is at most this many bytes has its prompt made on the event loop: the
# hand-off to a prompt thread and back costs more CPU than rendering, tokenizing and splicing
# such a prompt (about 0.15 ms a request), and holds the loop a few milliseconds at most.
INLINE_PROMPT_BYTES = 4 * 1024
# The body size of the request being served (set by the route, ``server.deps.BodyOffLoop``);
# unknown (None): the prompt thread, as for a large body.
REQUEST_BYTES: ContextVar[int | None] = ContextVar("proxrl_request_bytes", default=None)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    continues: LastTurn | None  # the turn this prompt extends token for token, if any


class Kind(Enum):
    TEXT = "text"  # must be in the rendered text as is
    SPECIAL = "special"  # a special token's text: may be missing
    END = "end"  # a special token that ends an answer (an eos token): may be missing
    START = "start"  # where an answer starts (after the generation prompt): empty
    OPEN = "open"  # <think>: with its block, up to the matching </think>, may be missing
    CLOSE = "close"  # </think>
    CALL = "call"  # a <tool_call> block that is a call: may come back written differently


@dataclass(frozen=True)
class Unit:
    """A piece of a turn's text as the splice rule reads it."""

    text: str
    kind: Kind


def splice(
    tokenizer: Tokenizer,
    prompt: str | PromptText,
    last: list[LastTurn],
    limit: int | None = None,
) -> Prompt:
    """Token ids of the prompt, reusing the tokens of the turn it extends. A ``str`` is text
    whose special tokens' texts all count (a text completion's prompt, written by the client
    in the template's form). A prompt of more than ``limit`` tokens raises ``TooManyTokens``."""
    if isinstance(prompt, str):
        prompt = PromptText(prompt)
    text = prompt.text
    for turn in last:
        end = len(turn.text) if text.startswith(turn.text) else None
        if end is None:
            end = aligned_end(turn_units(tokenizer, turn), text, _end_texts(tokenizer))
        if end is not None and end < len(text):
            prefix = turn.prompt_ids + turn.completion_ids
            rest = None if limit is None else limit - len(prefix)
            try:
                suffix = tokenizer.encode_prompt(prompt, end, rest)
            except TooManyTokens as exc:
                raise TooManyTokens(len(prefix) + exc.tokens) from None
            return Prompt(prefix + suffix, turn)
    return Prompt(tokenizer.encode_prompt(prompt, 0, limit), None)


async def off_loop(work: Callable[[], T]) -> T:
    """``work()`` on a prompt thread (``PROMPT_THREADS``), the event loop free meanwhile; for a
    request body of at most ``INLINE_PROMPT_BYTES``, on the loop itself (``REQUEST_BYTES``)."""
    size = REQUEST_BYTES.get()
    if size is not None and size <= INLINE_PROMPT_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_prompt_threads(), work)


@cache
def _prompt_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="proxrl-prompt")


def from_ids(ids: list[int], last: list[LastTurn]) -> Prompt:
    """A prompt given as token ids: it extends a turn when it starts with that turn's tokens."""
    for turn in last:
        prefix = turn.prompt_ids + turn.completion_ids
        if len(ids) > len(prefix) and ids[: len(prefix)] == prefix:
            return Prompt(ids, turn)
    return Prompt(ids, None)


def aligned_end(units: Sequence[Unit], text: str, end_texts: tuple[str, ...] = ()) -> int | None:
    """Where in ``text`` the turn made of ``units`` ends, reading it by the splice rule (module
    docstring): None when ``text`` does not begin with the turn. An optional part that ``text``
    holds is first taken as present; when the rest then fails to match, as absent. A turn whose
    last answer ends in dropped text is only read so when ``text`` then goes on with the end of
    an answer (one of ``end_texts``, the eos tokens: what templates write after an answer), so
    an edit of that answer cannot pass for new text."""
    if not _may_begin(units, text):
        return None
    return _readings(units, text, end_texts)


def _may_begin(units: Sequence[Unit], text: str) -> bool:
    """False where no reading of the turn can begin ``text``, judged on its units up to the
    first that is neither text nor a special token (a start, reasoning, a call): there every
    reading takes each text as it is, a special token as present or missing, so a text must
    stand in ``text`` between where the earliest and the latest reading got to. A few searches
    instead of the readings: a session's unrelated conversations all fail here."""
    low = high = 0  # where the readings so far can have got to in ``text``
    for index, unit in enumerate(units):
        if unit.kind is Kind.SPECIAL or unit.kind is Kind.END:
            high += len(unit.text)
        elif unit.kind is not Kind.TEXT or (
            index + 1 < len(units) and units[index + 1].kind is Kind.CLOSE
        ):
            return True
        else:
            first = text.find(unit.text, low, high + len(unit.text))
            if first < 0:
                return False
            last = text.rfind(unit.text, low, high + len(unit.text))
            low, high = first + len(unit.text), last + len(unit.text)
    return True


def _readings(units: Sequence[Unit], text: str, end_texts: tuple[str, ...]) -> int | None:
    """``aligned_end``, trying every reading (up to ``MAX_READINGS``)."""
    choices: list[State] = [(0, 0, False, False)]
    tried: set[State] = set()
    while choices and len(tried) < MAX_READINGS:
        state = choices.pop()
        if state not in tried:
            tried.add(state)
            found = _follow(units, text, state, choices, end_texts)
            if found is None:
                continue
            end, dropped_last = found
            if (
                not dropped_last
                or not end_texts
                or text.startswith(end_texts, _skip_space(text, end))
            ):
                return end
    return None


# The next unit, the place in the text, whether reasoning was just dropped (the whitespace after
# it may differ), whether inside a <think> block the text holds.
State = tuple[int, int, bool, bool]


def _follow(  # noqa: C901, PLR0912  # one matcher, a branch per unit kind
    units: Sequence[Unit],
    text: str,
    state: State,
    choices: list[State],
    end_texts: tuple[str, ...] = (),
) -> tuple[int, bool] | None:
    """Match ``units`` from ``state`` on, taking optional parts as present where ``text`` holds
    them (and noting the other way in ``choices``); None, or the end in ``text`` and whether
    the last answer ended in dropped text. An answer's eos token the text does not hold must
    give way to the end of an answer (one of ``end_texts``): text appended to an answer is an
    edit, not new text after it."""
    index, pos, after_drop, in_block = state
    while index < len(units):
        unit = units[index]
        index += 1
        if after_drop:  # the whitespace after dropped reasoning, on either side
            pos = _skip_space(text, pos)
        present = text.startswith(unit.text, pos)
        if unit.kind is Kind.CALL:
            end = pos + len(unit.text) if present else _same_call_end(unit.text, text, pos)
            if end is None:
                return None
            pos, after_drop = end, False
        elif unit.kind is Kind.TEXT:
            piece = unit.text.lstrip() if after_drop else unit.text
            before_close = index < len(units) and units[index].kind is Kind.CLOSE
            if before_close and in_block:  # templates re-render a kept block's newlines
                piece = piece.rstrip()
            elif before_close:
                choices += _cut_before_close(piece, text, pos, index + 1)
            if not text.startswith(piece, pos):
                return None
            pos, after_drop = pos + len(piece), after_drop and not piece
        elif unit.kind is Kind.CLOSE and in_block:
            pos = _skip_space(text, pos)
            if not text.startswith(unit.text, pos):
                return None
            pos, after_drop, in_block = pos + len(unit.text), True, False
        elif unit.kind is Kind.CLOSE:
            pos, after_drop = (pos + len(unit.text), False) if present else (pos, True)
        elif unit.kind is Kind.START:  # templates strip an answer's leading newlines (Qwen3)
            choices += [(close + 1, pos, True, False) for close in _answer_closes(units, index)]
            after_drop = True
        elif unit.kind is Kind.SPECIAL or unit.kind is Kind.END:
            in_block = in_block and unit.kind is Kind.SPECIAL  # an answer's end ends its block
            if present:
                choices.append((index, pos, after_drop, in_block))
                pos, after_drop = pos + len(unit.text), False
            elif unit.kind is Kind.END and not _ends_answer(text, pos, end_texts):
                return None
        else:  # OPEN; reasoning that the text holds, edited, is no dropped block
            edited = text.startswith(THINK_OPEN, _skip_space(text, pos))
            absent = None if edited else (_block_end(units, index), pos, True, False)
            if present:
                choices += [absent] if absent else []
                pos, after_drop, in_block = pos + len(unit.text), True, True
            elif absent is None:
                return None
            else:
                index, pos, after_drop, in_block = absent
    return pos, after_drop


def _same_call_end(block: str, text: str, pos: int) -> int | None:
    """Where the tool-call block at ``pos`` in ``text`` ends, when it is the sampled ``block``
    written differently (``tool_calls.same_call``); None when it is not."""
    if not text.startswith(CALL_OPEN, pos):
        return None
    close = text.find(CALL_CLOSE, pos + len(CALL_OPEN))
    if close < 0:
        return None
    sampled = block[len(CALL_OPEN) : -len(CALL_CLOSE)]
    if not same_call(sampled, text[pos + len(CALL_OPEN) : close]):
        return None
    return close + len(CALL_CLOSE)


def _ends_answer(text: str, pos: int, end_texts: tuple[str, ...]) -> bool:
    """Whether an answer's end (one of ``end_texts``; any place when none are known) is next."""
    return not end_texts or text.startswith(end_texts, _skip_space(text, pos))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@lru_cache(maxsize=8)
def _end_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    return tuple(sorted(tokenizer.token_text(token) for token in tokenizer.eos_token_ids))


def _answer_closes(units: Sequence[Unit], index: int) -> list[int]:
    """The ``</think>`` units of the answer starting at ``index``: templates that keep only what
    follows an answer's last ``</think>`` drop everything from its start to one of them."""
    closes = []
    for at in range(index, len(units)):
        if units[at].kind in (Kind.START, Kind.END):
            break
        if units[at].kind is Kind.CLOSE:
            closes.append(at)
    return closes


def _cut_before_close(piece: str, text: str, pos: int, after_close: int) -> list[State]:
    """Templates keep only what follows an answer's last ``</think>`` (Qwen3's and DeepSeek-R1's
    split the content there): the ways ``piece``, the text before a ``</think>`` that is not
    inside a block, may end early at ``pos`` in ``text``, the rest of it dropped with the
    marker (the answer after the marker may begin as the dropped text did). Fewest dropped
    characters last, so tried first."""
    same = 0
    limit = min(len(piece), len(text) - pos)
    while same < limit and piece[same] == text[pos + same]:
        same += 1
    return [(after_close, pos + kept, True, False) for kept in range(min(same, len(piece) - 1) + 1)]


def _block_end(units: Sequence[Unit], index: int) -> int:
    """The index after the ``</think>`` that closes a block whose body starts at ``index``; a
    block that never closes ends with its answer (at the eos token, or the end of the units)."""
    for at in range(index, len(units)):
        if units[at].kind is Kind.CLOSE:
            return at + 1
        if units[at].kind is Kind.END:
            return at
    return len(units)


def turn_units(tokenizer: Tokenizer, turn: LastTurn) -> list[Unit]:
    """``units_of`` the turn's prompt + completion, made once per turn: a session's every
    later prompt that does not begin with the turn's text reads it again."""
    units = turn.units.get(tokenizer)
    if units is None:
        units = turn.units[tokenizer] = units_of(tokenizer, turn.prompt_ids + turn.completion_ids)
    return units


def units_of(tokenizer: Tokenizer, ids: Sequence[int]) -> list[Unit]:
    """The text of ``ids`` as units: special tokens apart, each run of other tokens decoded
    together and cut at its ``<think>``/``</think>`` markers, a start marked after each of the
    template's generation prompts."""
    return _mark_starts(_token_units(tokenizer, ids), generation_prompt(tokenizer))


def _mark_starts(units: list[Unit], opening: str) -> list[Unit]:
    """``units`` with a START unit after each occurrence of ``opening`` in their text."""
    text = "".join(unit.text for unit in units)
    ends = []
    at = text.find(opening) if opening else -1
    while at >= 0:
        ends.append(at + len(opening))
        at = text.find(opening, at + 1)
    marked: list[Unit] = []
    offset = 0
    for unit in units:
        size = len(unit.text)
        cuts = [end - offset for end in ends if offset < end <= offset + size]
        done = 0
        for cut in cuts:
            if cut < size and unit.kind is not Kind.TEXT:
                continue  # a special token is never cut
            if cut > done:
                marked.append(Unit(unit.text[done:cut], unit.kind))
            marked.append(Unit("", Kind.START))
            done = cut
        if done < size:
            marked.append(Unit(unit.text[done:], unit.kind))
        offset += size
    return marked


def _token_units(tokenizer: Tokenizer, ids: Sequence[int]) -> list[Unit]:
    units: list[Unit] = []
    run: list[int] = []
    for token in ids:
        if _is_special(tokenizer, token):
            units += _text_units(tokenizer.decode(run, skip_special_tokens=False))
            kind = Kind.END if token in tokenizer.eos_token_ids else Kind.SPECIAL
            units.append(Unit(tokenizer.token_text(token), kind))
            run = []
        else:
            run.append(token)
    return units + _text_units(tokenizer.decode(run, skip_special_tokens=False))


def _text_units(text: str) -> list[Unit]:
    units = []
    while text:
        marks = [(text.find(m), m) for m in (THINK_OPEN, THINK_CLOSE) if m in text]
        if not marks:
            units += _call_units(text)
            break
        at, mark = min(marks)
        if at:
            units += _call_units(text[:at])
        units.append(Unit(mark, Kind.OPEN if mark == THINK_OPEN else Kind.CLOSE))
        text = text[at + len(mark) :]
    return units


def _call_units(text: str) -> list[Unit]:
    """``text`` as TEXT units, bar the tool-call blocks in it that are calls (CALL units). A
    block is cut as ``tool_calls`` reads one: from ``<tool_call>`` to the first
    ``</tool_call>``."""
    units = []
    start = 0
    at = text.find(CALL_OPEN)
    while at >= 0:
        close = text.find(CALL_CLOSE, at + len(CALL_OPEN))
        if close < 0:
            break
        end = close + len(CALL_CLOSE)
        if is_call(text[at + len(CALL_OPEN) : close]):
            if at > start:
                units.append(Unit(text[start:at], Kind.TEXT))
            units.append(Unit(text[at:end], Kind.CALL))
            start = end
        at = text.find(CALL_OPEN, end)
    if start < len(text):
        units.append(Unit(text[start:], Kind.TEXT))
    return units


@lru_cache(maxsize=65536)
def _is_special(tokenizer: Tokenizer, token: int) -> bool:
    """A token that decoding leaves out (what a client is served never holds it)."""
    return tokenizer.decode([token]) == "" and tokenizer.token_text(token) != ""
