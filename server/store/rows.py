"""Training rows from turns: the pure rule that merges a multi-turn session into rows.

A turn whose prompt extends the previous turn's prompt + completion token for token continues
that turn's row: its new prompt tokens (tool results, the next user message, template glue) get
loss mask 0 and its completion tokens loss mask 1. Any other turn starts a new row (a "break":
the agent edited or dropped history). This module knows nothing about SQL or HTTP.

A turn is an *alternative* when the session did not go on from it: every choice of a request
that was retried (the next request asks the same again), and every choice but the one the next
request continues (choice 0 when the next request continues none, or there is none). The rows
keep alternatives; each row's turns say which they are, and the trainer decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROMPT_VERSION = -1  # version recorded for prompt positions, which no policy sampled


@dataclass(frozen=True)
class TurnTokens:
    completion_id: str
    request_id: str  # the choices of one request (n > 1) share it
    turn_index: int
    row_index: int
    extends_previous: bool  # it continues a turn of the previous request in that turn's row
    messages: list[Any] | None  # what its request asked (chat; None: a prompt of token ids)
    tools: list[Any] | None
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    temperature: float | None = None  # the temperature it was sampled at (None: unknown)
    reward: float | None = None


@dataclass
class Row:
    """One training sequence: tokens, which of them are trained, and how they were sampled."""

    row_index: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 on prompt
    versions: list[int] = field(default_factory=list)  # PROMPT_VERSION on prompt positions
    # completion_id, turn_index, start, end, reward, temperature, alternative
    turns: list[dict] = field(default_factory=list)


def continues(prev_prompt: list[int], prev_completion: list[int], prompt: list[int]) -> bool:
    """Does ``prompt`` extend the previous turn's prompt + completion exactly?"""
    prefix_len = len(prev_prompt) + len(prev_completion)
    return (
        len(prompt) > prefix_len
        and prompt[: len(prev_prompt)] == prev_prompt
        and prompt[len(prev_prompt) : prefix_len] == prev_completion
    )


def asks_the_same(turn: TurnTokens, other: TurnTokens) -> bool:
    """Did the two turns' requests ask the same, i.e. is one a retry of the other? Chat requests
    by their messages and tools, others by their prompt token ids. The whole history is only
    compared when the message counts match, and equality stops at the first difference."""
    if turn.messages is None or other.messages is None:
        return turn.messages is other.messages and turn.prompt_ids == other.prompt_ids
    return (
        len(turn.messages) == len(other.messages)
        and turn.messages == other.messages
        and turn.tools == other.tools
    )


def requests_of(turns: Sequence[TurnTokens]) -> list[list[TurnTokens]]:
    """The session's requests in order, each its turns by turn_index (choice 0 first)."""
    by_request: dict[str, list[TurnTokens]] = {}
    for turn in sorted(turns, key=lambda t: t.turn_index):
        by_request.setdefault(turn.request_id, []).append(turn)
    return list(by_request.values())


def path_turn(request: list[TurnTokens], following: list[TurnTokens] | None) -> TurnTokens | None:
    """The turn of ``request`` the session went on from, given the request after it: none when
    that one is a retry, the turn it continues, else choice 0."""
    if following is None:
        return request[0]
    first = following[0]
    if asks_the_same(first, request[0]):
        return None
    if first.extends_previous:
        for turn in request:
            if turn.row_index == first.row_index:
                return turn
    return request[0]


def alternatives(turns: Sequence[TurnTokens]) -> set[str]:
    """The completion ids of the session's turns that are alternatives (the rule above)."""
    requests = requests_of(turns)
    found: set[str] = set()
    for index, request in enumerate(requests):
        following = requests[index + 1] if index + 1 < len(requests) else None
        kept = path_turn(request, following)
        found.update(turn.completion_id for turn in request if turn is not kept)
    return found


def assemble_rows(turns: list[TurnTokens]) -> list[Row]:
    """Rows of a session from its turns in order (turns of one row share ``row_index``)."""
    off_path = alternatives(turns)
    rows: dict[int, Row] = {}
    for turn in turns:
        row = rows.get(turn.row_index)
        if row is None:
            row = rows[turn.row_index] = Row(row_index=turn.row_index)
            new_prompt = turn.prompt_ids
        else:
            new_prompt = turn.prompt_ids[len(row.input_ids) :]
        row.input_ids += new_prompt
        row.loss_mask += [0] * len(new_prompt)
        row.logprobs += [0.0] * len(new_prompt)
        row.versions += [PROMPT_VERSION] * len(new_prompt)
        start = len(row.input_ids)
        row.input_ids += turn.completion_ids
        row.loss_mask += [1] * len(turn.completion_ids)
        row.logprobs += turn.logprobs
        row.versions += turn.versions
        row.turns.append(
            {
                "completion_id": turn.completion_id,
                "turn_index": turn.turn_index,
                "start": start,
                "end": len(row.input_ids),
                "reward": turn.reward,
                "temperature": turn.temperature,
                "alternative": turn.completion_id in off_path,
            }
        )
    return [rows[index] for index in sorted(rows)]
