"""What the proxy keeps in memory about each session between its turns.

To continue a training row, the next turn's prompt must repeat the previous turn's tokens
exactly; the registry remembers the last request's turns (tokens and their text) and where each
row ends, so prompts can be built by splicing those exact tokens instead of re-tokenizing what
the model said. State is loaded from the store on first use (after a restart, say).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from server.store import sessions as store_sessions
from server.store import turns as store_turns
from server.store.database import Sessionmaker
from server.store.packing import unpack_ints
from server.store.tables import Turn
from server.text.tokenization import Tokenizer


@dataclass(frozen=True)
class LastTurn:
    completion_id: str
    row_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str  # the text of prompt + completion, special tokens included


@dataclass(eq=False)
class SessionState:
    id: str
    run_id: str
    status: str
    next_turn: int = 0
    next_row: int = 0
    last: list[LastTurn] = field(default_factory=list)
    row_tails: dict[int, str] = field(default_factory=dict)  # row -> its last completion_id
    engine: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def has_turns(self) -> bool:
        return self.next_turn > 0


def last_turn(
    tokenizer: Tokenizer,
    completion_id: str,
    row_index: int,
    prompt_ids: list[int],
    completion_ids: list[int],
) -> LastTurn:
    text = tokenizer.decode(prompt_ids + completion_ids, skip_special_tokens=False)
    return LastTurn(completion_id, row_index, prompt_ids, completion_ids, text)


class SessionRegistry:
    def __init__(
        self, sessionmaker: Sessionmaker, tokenizer: Tokenizer, capacity: int = 20_000
    ) -> None:
        self._sessionmaker = sessionmaker
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._states: OrderedDict[str, SessionState] = OrderedDict()

    async def get(self, session_id: str) -> SessionState | None:
        state = self._states.get(session_id)
        if state is None:
            state = await self._load(session_id)
            if state is None:
                return None
            self._states[session_id] = state
            while len(self._states) > self._capacity:
                self._states.popitem(last=False)
        self._states.move_to_end(session_id)
        return state

    def set_status(self, session_id: str, status: str) -> None:
        state = self._states.get(session_id)
        if state is not None:
            state.status = status

    async def _load(self, session_id: str) -> SessionState | None:
        async with self._sessionmaker() as db:
            session = await store_sessions.get_session(db, session_id)
            if session is None:
                return None
            state = SessionState(session.id, session.run_id, session.status, engine=session.engine)
            last = await store_turns.last_request_turns(db, session_id)
            top_row = await store_turns.last_row_index(db, session_id)
        if last:
            state.next_turn = max(t.turn_index for t in last) + 1
            state.next_row = int(top_row or 0) + 1
            state.last = [self._from_turn(t) for t in last]
            state.row_tails = {t.row_index: t.completion_id for t in last}
        return state

    def _from_turn(self, turn: Turn) -> LastTurn:
        return last_turn(
            self._tokenizer,
            turn.completion_id,
            turn.row_index,
            unpack_ints(turn.prompt_ids),
            unpack_ints(turn.completion_ids),
        )
