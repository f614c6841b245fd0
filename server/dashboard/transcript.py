"""A session's turns as a chat transcript: each turn shows only what is new in its prompt.

An agent resends its whole history with every call, so a turn whose messages begin with the
previous turn's messages and reply shows just the messages after them; any other turn (the
agent rewrote its history: a multi-turn break) shows all of its messages. Choices of one request
(n > 1) share their prompt. Pure: plain data in, plain data out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.rl.schemas import TurnOut


@dataclass
class TranscriptTurn:
    turn: TurnOut
    messages: list[Any] = field(default_factory=list)  # what the prompt adds
    hidden: int = 0  # earlier messages not repeated
    same_request: bool = False  # another choice of the request above


def transcript(turns: list[TurnOut]) -> list[TranscriptTurn]:
    out: list[TranscriptTurn] = []
    previous: TurnOut | None = None
    for turn in turns:
        if previous is not None and turn.request_id == previous.request_id:
            out.append(TranscriptTurn(turn, same_request=True))
            continue
        messages = list(turn.messages or [])
        seen = _history(previous)
        if seen and [_key(m) for m in messages[: len(seen)]] == [_key(m) for m in seen]:
            out.append(TranscriptTurn(turn, messages[len(seen) :], hidden=len(seen)))
        else:
            out.append(TranscriptTurn(turn, messages))
        previous = turn
    return out


def _history(turn: TurnOut | None) -> list[Any]:
    """The messages a continuation of ``turn`` starts with: its prompt, then its reply."""
    if turn is None or turn.messages is None:
        return []
    return [*turn.messages, turn.response]


def _key(message: Any) -> tuple[Any, str]:
    """What identifies a message across resends (clients add or drop empty fields)."""
    if not isinstance(message, dict):
        return (None, str(message))
    return (message.get("role"), str(message.get("content") or ""))
