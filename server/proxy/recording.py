"""Record served completions as turns: which training row each one belongs to, then the store.

The first completion of a request continues the row of the turn its prompt extends, if that
turn is still the row's last; every other completion opens a row (parallel samples of n > 1
share a prompt but not a row). A request that extends no previous turn in a session that has
turns is a break, unless it is a retry: the same prompt token ids as the previous request (a
timeout, an error, a framework's retry), whose turns ``rows`` then marks as alternatives unless
the session goes on from one of them. State moves on only once the store has committed.

What the next prompt may continue (``state.last``): the request's turns, then the attempts it
retried (the agent may go on from an earlier answer that came late), then the turn it continued
(so that a retry splices onto the same tokens and asks with the very same prompt ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.proxy.generation import Completion
from server.proxy.prompts import Prompt
from server.proxy.session_cache import LastTurn, SessionState, last_turn
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


async def record(
    writer: TurnWriter,
    tokenizer: Tokenizer,
    state: SessionState,
    prompt: Prompt,
    served: list[Served],
    log: RequestLog,
) -> None:
    async with state.lock:
        tails = dict(state.row_tails)
        next_turn, next_row = state.next_turn, state.next_row
        continued = prompt.continues
        continued_row = None
        if continued is not None and tails.get(continued.row_index) == continued.completion_id:
            continued_row = continued.row_index
        records, lasts = [], []
        for index, item in enumerate(served):
            if index == 0 and continued_row is not None:
                row, new_row = continued_row, False
            else:
                row, new_row = next_row, True
                next_row += 1
            tails[row] = item.completion_id
            records.append(_record(state, prompt, item, log, next_turn, row, new_row))
            lasts.append(
                last_turn(tokenizer, item.completion_id, row, prompt.ids, item.completion.ids)
            )
            next_turn += 1
        retried = retried_turns(state.last, prompt.ids)
        if continued_row is None and state.has_turns and not retried:
            records[0].is_break = True
        await writer.write(records)
        state.next_turn, state.next_row = next_turn, next_row
        state.row_tails, state.last = tails, next_last(lasts, retried, continued)
        state.engine = served[0].completion.engine


def retried_turns(last: list[LastTurn], prompt_ids: list[int]) -> list[LastTurn]:
    """The previous request's turns (and its earlier attempts) when this request asks with the
    very same prompt ids: a retry. ``last[0]`` is the previous request's first choice."""
    if not last or last[0].prompt_ids != prompt_ids:
        return []
    return [turn for turn in last if turn.prompt_ids == prompt_ids]


def next_last(
    turns: list[LastTurn], retried: list[LastTurn], continued: LastTurn | None
) -> list[LastTurn]:
    """What the session's next prompt may continue, in the order tried (``prompts.splice`` takes
    the first match, and a turn's text begins with the text of the turn it continued)."""
    kept = turns + retried
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
