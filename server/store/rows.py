"""Training rows from turns: the pure rule that merges a multi-turn session into rows.

A turn whose prompt extends the previous turn's prompt + completion token for token continues
that turn's row: its new prompt tokens (tool results, the next user message, template glue) get
loss mask 0 and its completion tokens loss mask 1. Any other turn starts a new row (a "break":
the agent edited or dropped history). This module knows nothing about SQL or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_VERSION = -1  # version recorded for prompt positions, which no policy sampled


@dataclass(frozen=True)
class TurnTokens:
    completion_id: str
    row_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float | None = None


@dataclass
class Row:
    """One training sequence: tokens, which of them are trained, and how they were sampled."""

    row_index: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 on prompt
    versions: list[int] = field(default_factory=list)  # PROMPT_VERSION on prompt positions
    turns: list[dict] = field(default_factory=list)  # completion_id, start, end, reward


def continues(prev_prompt: list[int], prev_completion: list[int], prompt: list[int]) -> bool:
    """Does ``prompt`` extend the previous turn's prompt + completion exactly?"""
    prefix_len = len(prev_prompt) + len(prev_completion)
    return (
        len(prompt) > prefix_len
        and prompt[: len(prev_prompt)] == prev_prompt
        and prompt[len(prev_prompt) : prefix_len] == prev_completion
    )


def assemble_rows(turns: list[TurnTokens]) -> list[Row]:
    """Rows of a session from its turns in order (turns of one row share ``row_index``)."""
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
                "start": start,
                "end": len(row.input_ids),
                "reward": turn.reward,
            }
        )
    return [rows[index] for index in sorted(rows)]
