"""Training rows from turns: the pure rule that merges a multi-turn session into rows.

A turn whose prompt extends an earlier turn's prompt + completion token for token, that turn
still the last of its row, continues that row: its new prompt tokens (tool results, the next
user message, template glue) get loss mask 0 and its completion tokens loss mask 1. Any other
turn starts a new row: the first turn of a conversation (the session's first request, or a side
request such as a title or a sub-agent: ``conversation`` tells them apart), a "break" (the agent
edited or dropped a conversation's history), a retry, or a parallel sample (n > 1). This module
knows nothing about SQL or HTTP.

A turn is an *alternative* when the session did not go on from it. Requests of one conversation
that ask the same one after another (a retry: a timeout, an error, a framework's retry; a side
request in between does not part them) are one *attempt group*: its kept turns are those a later
turn continues (normally one: the answer the agent used), else choice 0 of its last attempt;
every other turn of the group is an alternative, and each attempt none of whose turns is kept
counts as a retry. A lone request keeps the choice the session continued, else choice 0. The
rows keep alternatives; each row's turns say which they are, and the trainer decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    surface: str = "chat"  # the API its request came through (chat, completions, ...)
    conversation: int = 0  # the session's conversation it belongs to
    finish_reason: str | None = None  # why its answer ended: "length" when the limit cut it


@dataclass
class Row:
    """One training sequence: tokens, which of them are trained, and how they were sampled."""

    row_index: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 on prompt
    versions: list[int] = field(default_factory=list)  # PROMPT_VERSION on prompt positions
    # completion_id, turn_index, start, end, reward, temperature, alternative, finish_reason
    turns: list[dict] = field(default_factory=list)


def continues(prev_prompt: list[int], prev_completion: list[int], prompt: list[int]) -> bool:
    """Does ``prompt`` extend the previous turn's prompt + completion exactly?"""
    prefix_len = len(prev_prompt) + len(prev_completion)
    return (
        len(prompt) > prefix_len
        and prompt[: len(prev_prompt)] == prev_prompt
        and prompt[len(prev_prompt) : prefix_len] == prev_completion
    )


class Asked(Protocol):
    """What a request asked, as a turn of it records it."""

    @property
    def prompt_ids(self) -> object: ...  # token ids, or the store's packed form of them
    @property
    def surface(self) -> str: ...
    @property
    def messages(self) -> list[Any] | None: ...
    @property
    def tools(self) -> list[Any] | None: ...


def asks_the_same(turn: Asked, other: Asked) -> bool:
    """Did the two turns' requests ask the same, i.e. is one a retry of the other? The same
    prompt token ids, on any surface; chat requests also by their messages and tools (the same
    conversation may tokenize otherwise once its history is no longer spliced). Equality stops
    at the first difference. The one definition of a retry: the recorder places requests by it
    (``recording.place``), and the rows, the counters and the dashboard read it back."""
    if turn.prompt_ids == other.prompt_ids:
        return True
    return (
        turn.surface == other.surface == "chat"
        and turn.messages is not None
        and other.messages is not None
        and len(turn.messages) == len(other.messages)
        and turn.messages == other.messages
        and turn.tools == other.tools
    )


def requests_of(turns: Sequence[TurnTokens]) -> list[list[TurnTokens]]:
    """The session's requests in order, each its turns by turn_index (choice 0 first)."""
    by_request: dict[str, list[TurnTokens]] = {}
    for turn in sorted(turns, key=lambda t: t.turn_index):
        by_request.setdefault(turn.request_id, []).append(turn)
    return list(by_request.values())


def attempt_groups(requests: list[list[TurnTokens]]) -> list[list[list[TurnTokens]]]:
    """The requests in runs of ones of a conversation that ask the same one after another (a
    request and its retries), in the order of their first request."""
    groups: list[list[list[TurnTokens]]] = []
    latest: dict[int, list[list[TurnTokens]]] = {}  # conversation -> its latest group
    for request in requests:
        group = latest.get(request[0].conversation)
        if group is not None and asks_the_same(request[0], group[-1][0]):
            group.append(request)
        else:
            group = latest[request[0].conversation] = [request]
            groups.append(group)
    return groups


def continued(turns: Sequence[TurnTokens]) -> set[str]:
    """The completion ids of turns that a later turn of their row extends."""
    by_row: dict[int, list[TurnTokens]] = {}
    for turn in turns:
        by_row.setdefault(turn.row_index, []).append(turn)
    found: set[str] = set()
    for row in by_row.values():
        row.sort(key=lambda t: t.turn_index)
        found.update(turn.completion_id for turn in row[:-1])
    return found


@dataclass(frozen=True)
class OnPath:
    """Which turns the session went on from, and which requests were retried."""

    kept: set[str]  # completion ids
    retried: set[str]  # request ids of attempts none of whose turns is kept


def session_path(turns: Sequence[TurnTokens]) -> OnPath:
    """The kept turns and the retried requests of a session (the rule above)."""
    went_on = continued(turns)
    kept: set[str] = set()
    retried: set[str] = set()
    for group in attempt_groups(requests_of(turns)):
        chosen = {t.completion_id for request in group for t in request} & went_on
        kept |= chosen or {group[-1][0].completion_id}
        retried.update(
            request[0].request_id
            for request in group
            if not any(t.completion_id in kept for t in request)
        )
    return OnPath(kept, retried)


def alternatives(turns: Sequence[TurnTokens]) -> set[str]:
    """The completion ids of the session's turns that are alternatives (the rule above)."""
    kept = session_path(turns).kept
    return {turn.completion_id for turn in turns} - kept


def retries(turns: Sequence[TurnTokens]) -> int:
    """How many of the session's requests were retried: attempts the session did not go on from,
    every one of their turns an alternative."""
    return len(session_path(turns).retried)


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
                "finish_reason": turn.finish_reason,
            }
        )
    return [rows[index] for index in sorted(rows)]
