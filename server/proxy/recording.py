"""Record served completions as turns: which conversation and training row each belongs to,
then the store.

A request is placed in one of the session's conversations (docs/concepts.md), tried in order:

1. **continue**: its prompt extends a turn of a conversation token for token
   (``prompt.continues``): that conversation. Its first completion continues the turn's row if
   the turn is still the row's last; otherwise (the agent went back to an earlier answer) it
   opens a row and is a *break*, unless it is a retry.
2. **retry**: asks the same as a conversation's latest request (``rows.asks_the_same``: the same
   prompt token ids, or on chat the same messages and tools; a timeout, an error, a framework's
   retry): that conversation, a new row, whose turns ``rows`` then marks as
   alternatives unless the session goes on from one of them. Not a break.
3. **break**: its prompt begins with a conversation's *opening* (that conversation's first
   prompt up to the header of the answer it asked for: the same system prompt, tools and first
   message) but continues none of its turns: the agent edited, dropped or re-rendered that
   conversation's history (or started it over). A new row of that conversation (the latest
   active, of several with that opening; the longest opening first).
4. **new**: anything else (a title or summary request, a sub-agent under its own system
   prompt, an agent's history compacted into a new first message) starts a conversation: a new
   row, not a break.

Parallel samples (n > 1) share their request's conversation; every completion but the first
opens a row. State moves on only once the store has committed.

What the conversation's next prompt may continue (``Conversation.last``): the request's turns,
then up to ``MAX_RETRIED_KEPT`` answers of attempts it retried (the agent may go on from an
earlier answer that came late), then the turn it continued (so that a retry splices onto the
same tokens and asks with the very same prompt ids). Bounded: a session that sends the same
prompt again and again keeps the same few turns, and its requests cost the same however many
came before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from server.proxy.generation import Completion
from server.proxy.prompts import Prompt
from server.proxy.session_cache import (
    MAX_RETRIED_KEPT,
    Conversation,
    LastTurn,
    SessionState,
    last_turn,
    opening_length,
)
from server.store.rows import asks_the_same
from server.store.turns import TurnRecord
from server.store.writer import TurnWriter
from server.text.tokenization import Tokenizer


@dataclass(frozen=True)
class Served:
    completion_id: str
    completion: Completion
    response: dict[str, Any]  # what the client got: the message, or the text
    finish_reason: str  # as the client got it: stop, length, tool_calls


@dataclass(frozen=True)
class RequestLog:
    request_id: str
    surface: str  # chat, completions, responses, messages
    model: str | None  # the model name the request asked for
    messages: list[Any] | None
    tools: list[Any] | None
    sampling: dict[str, Any]


class Kind(Enum):
    CONTINUE = "continue"
    RETRY = "retry"
    BREAK = "break"
    NEW = "new"


@dataclass(frozen=True)
class Place:
    """Where a request goes: its conversation, how (:class:`Kind`), the row its first
    completion continues (None: it opens one) and the earlier attempts it retried."""

    conversation: Conversation
    kind: Kind
    continued_row: int | None
    retried: list[LastTurn]


def place(
    state: SessionState, prompt: Prompt, opening: Callable[[], int], log: RequestLog
) -> Place:
    """The rule in the module docstring. ``opening`` gives the opening of the prompt, should it
    start a conversation; ``log`` what the request asked."""
    asked = LastTurn("", -1, prompt.ids, [], "", 0, log.surface, log.messages, log.tools)
    continued = prompt.continues
    if continued is not None and continued.conversation in state.conversations:
        conversation = state.conversations[continued.conversation]
        retried = retried_turns(conversation.last, asked)
        if state.row_tails.get(continued.row_index) == continued.completion_id:
            return Place(conversation, Kind.CONTINUE, continued.row_index, retried)
        return Place(conversation, Kind.RETRY if retried else Kind.BREAK, None, retried)
    recent_first = list(reversed(state.conversations.values()))
    for conversation in recent_first:
        retried = retried_turns(conversation.last, asked)
        if retried:
            return Place(conversation, Kind.RETRY, None, retried)
    opened = [c for c in recent_first if c.opened_by(prompt.ids)]
    if opened:
        conversation = max(opened, key=lambda c: c.opening)  # the first of equals: most recent
        return Place(conversation, Kind.BREAK, None, [])
    conversation = Conversation(state.next_conversation, opening())
    return Place(conversation, Kind.NEW, None, [])


async def record(
    writer: TurnWriter,
    tokenizer: Tokenizer,
    state: SessionState,
    prompt: Prompt,
    served: list[Served],
    log: RequestLog,
) -> None:
    async with state.lock:
        found = place(state, prompt, lambda: opening_length(tokenizer, prompt.ids), log)
        conversation = found.conversation
        tails = dict(state.row_tails)
        next_turn, next_row = state.next_turn, state.next_row
        records, lasts = [], []
        for index, item in enumerate(served):
            if index == 0 and found.continued_row is not None:
                row, new_row = found.continued_row, False
            else:
                row, new_row = next_row, True
                next_row += 1
            tails[row] = item.completion_id
            records.append(
                _record(state, prompt, item, log, next_turn, row, new_row, conversation.index)
            )
            lasts.append(
                last_turn(
                    tokenizer,
                    item.completion_id,
                    row,
                    prompt.ids,
                    item.completion.ids,
                    conversation.index,
                    (log.surface, log.messages, log.tools),
                )
            )
            next_turn += 1
        records[0].is_break = found.kind is Kind.BREAK
        records[0].new_conversation = found.kind is Kind.NEW
        await writer.write(records)
        state.next_turn, state.next_row = next_turn, next_row
        if found.kind is Kind.NEW:
            state.next_conversation = conversation.index + 1
        continued = prompt.continues if found.kind is not Kind.NEW else None
        conversation.last = next_last(lasts, found.retried, continued)
        state.remember(conversation, tails)
        state.engine = served[0].completion.engine


def retried_turns(last: list[LastTurn], asked: LastTurn) -> list[LastTurn]:
    """The conversation's latest request's turns (and its earlier attempts) when this request
    (``asked``) asks the same (``rows.asks_the_same``, the one definition of a retry): a retry.
    ``last[0]`` is that request's first choice."""
    if not last or not asks_the_same(last[0], asked):
        return []
    return [turn for turn in last if asks_the_same(turn, asked)]


def next_last(
    turns: list[LastTurn], retried: list[LastTurn], continued: LastTurn | None
) -> list[LastTurn]:
    """What the conversation's next prompt may continue, in the order tried (``prompts.splice``
    takes the first match, and a turn's text begins with the text of the turn it continued):
    the request's turns, the answers of the attempts it retried, latest first (at most
    ``MAX_RETRIED_KEPT``), the turn it continued."""
    kept = turns + retried[:MAX_RETRIED_KEPT]
    if continued is not None and continued not in kept:
        kept.append(continued)
    return kept


def _record(
    state: SessionState,
    prompt: Prompt,
    item: Served,
    log: RequestLog,
    turn_index: int,
    row: int,
    new_row: bool,
    conversation: int,
) -> TurnRecord:
    completion = item.completion
    return TurnRecord(
        session_id=state.id,
        run_id=state.run_id,
        completion_id=item.completion_id,
        request_id=log.request_id,
        surface=log.surface,
        model=log.model,
        turn_index=turn_index,
        row_index=row,
        extends_previous=not new_row,
        conversation=conversation,
        prompt_ids=prompt.ids,
        completion_ids=completion.ids,
        logprobs=completion.logprobs,
        versions=completion.versions,
        finish_reason=item.finish_reason,
        messages=log.messages,
        tools=log.tools,
        response=item.response,
        sampling=log.sampling,
        engine=completion.engine,
        resubmits=completion.resumes,
        new_row=new_row,
    )
