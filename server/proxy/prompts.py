"""Prompt token ids for a turn, continuing the session's last turn token for token when it can.

The agent sends back, as history, text the model generated. Re-tokenizing that text could give
other tokens than the ones sampled, which would break the training row. So when the rendered
prompt begins with the exact text of a previous turn (its prompt + completion), the prompt is
built as that turn's token ids followed by the tokens of the new text only. Otherwise it is
tokenized from scratch, and the turn starts a new row.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.proxy.session_cache import LastTurn
from server.text.tokenization import Tokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    continues: LastTurn | None  # the turn this prompt extends token for token, if any


def splice(tokenizer: Tokenizer, text: str, last: list[LastTurn]) -> Prompt:
    """Token ids of the prompt ``text``, reusing the tokens of the turn it extends."""
    for turn in last:
        if len(text) > len(turn.text) and text.startswith(turn.text):
            suffix = tokenizer.encode(text[len(turn.text) :])
            return Prompt(turn.prompt_ids + turn.completion_ids + suffix, turn)
    return Prompt(tokenizer.encode(text), None)


def from_ids(ids: list[int], last: list[LastTurn]) -> Prompt:
    """A prompt given as token ids: it extends a turn when it starts with that turn's tokens."""
    for turn in last:
        prefix = turn.prompt_ids + turn.completion_ids
        if len(ids) > len(prefix) and ids[: len(prefix)] == prefix:
            return Prompt(ids, turn)
    return Prompt(ids, None)
