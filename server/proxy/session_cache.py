"""What the proxy keeps in memory about each session between its turns.

To continue a training row, the next turn's prompt must repeat the previous turn's tokens
exactly; the registry remembers, for each of the session's conversations, the last request's
turns (tokens and their text) and where each row ends, so prompts can be built by splicing those
exact tokens instead of re-tokenizing what the model said. State is loaded from the store on
first use (after a restart, or on another replica): everything here is derivable from the
session's turns, which record their conversation.

A session holds *conversations* (docs/concepts.md): the agent's main thread, and the side
requests an agent sends in the same session (a title, a summary, a sub-agent). Each
conversation has an *opening*: its first prompt up to the header of the answer it asked for
(:func:`opening_length`); every later request of the conversation begins with it. A session's
state is bounded: the :data:`MAX_CONVERSATIONS` most recently active conversations, and of each
the last request's turns, :data:`MAX_RETRIED_KEPT` answers of earlier attempts of the same
prompt and the turn it continued. The registry is bounded in bytes (``--session-cache-mb``):
the least recently used sessions are dropped, and reloaded from the store at their next
request; a dropped state a request still holds stays the session's one state until that
request is done, so two requests of a session never work on two copies.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import takewhile
from typing import Any

from server.store import sessions as store_sessions
from server.store import turns as store_turns
from server.store.byte_lru import MB, ByteLRU, nbytes
from server.store.database import Sessionmaker
from server.store.packing import unpack_ints
from server.store.rows import asks_the_same
from server.store.tables import Turn
from server.text.tokenization import Tokenizer

# Conversations a session remembers (the most recently active); a request that continues an
# older one starts a new conversation.
MAX_CONVERSATIONS = 16
# Answers of earlier attempts of the same prompt (retries) the next prompt may still continue.
MAX_RETRIED_KEPT = 3


@dataclass(frozen=True)
class LastTurn:
    completion_id: str
    row_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str  # the text of prompt + completion, special tokens included
    conversation: int = 0
    # what its request asked, to tell a retry (``rows.asks_the_same``)
    surface: str = "chat"
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    # its text as the splice rule reads it, made once by the first prompt that needs it
    # (``prompts.units_of``): tokenizer -> units
    units: dict[Any, list[Any]] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def nbytes(self) -> int:
        """What it takes in memory (its token ids dominate: ``byte_lru.INT_IN_LIST`` each),
        its splice units counted as its text again whether made yet or not."""
        parts = (self.prompt_ids, self.completion_ids, self.text, self.messages, self.tools)
        return 160 + nbytes(self.text) + sum(nbytes(part) for part in parts)


@dataclass(eq=False)
class Conversation:
    index: int  # its number in the session, from 0, in order of first request
    opening: int  # how many tokens of each of its prompts are its opening
    last: list[LastTurn] = field(default_factory=list)  # what its next prompt may continue

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Does ``prompt_ids`` begin with this conversation's opening?"""
        if not self.last or len(prompt_ids) < self.opening:
            return False
        reference = self.last[0].prompt_ids
        return prompt_ids[: self.opening] == reference[: self.opening]


@dataclass(eq=False)
class SessionState:
    id: str
    run_id: str
    status: str
    next_turn: int = 0
    next_row: int = 0
    next_conversation: int = 0
    # Most recently active last; at most MAX_CONVERSATIONS.
    conversations: OrderedDict[int, Conversation] = field(default_factory=OrderedDict)
    # row -> its last completion_id, for the rows of the turns in ``last``
    row_tails: dict[int, str] = field(default_factory=dict)
    engine: str | None = None
    production: bool = False  # never trained: served its run's promoted version, if any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # told when what it keeps changed (the registry measures it again)
    on_change: Callable[[SessionState], None] | None = None

    @property
    def nbytes(self) -> int:
        """What it keeps, in bytes: its turns (each measured once) and a little bookkeeping."""
        turns = sum(turn.nbytes for c in self.conversations.values() for turn in c.last)
        return 1024 + turns + 100 * len(self.row_tails)

    @property
    def has_turns(self) -> bool:
        return self.next_turn > 0

    @property
    def last(self) -> list[LastTurn]:
        """What the session's next prompt may continue, in the order tried: the most recently
        active conversation's turns first (``prompts.splice`` takes the first match)."""
        return [turn for c in reversed(self.conversations.values()) for turn in c.last]

    def remember(self, conversation: Conversation, tails: dict[int, str]) -> None:
        """Keep ``conversation`` as the most recently active (forgetting the least recently
        active beyond the bound), and the tails of the rows its turns and the others' are in."""
        self.conversations[conversation.index] = conversation
        self.conversations.move_to_end(conversation.index)
        while len(self.conversations) > MAX_CONVERSATIONS:
            self.conversations.popitem(last=False)
        rows = {turn.row_index for turn in self.last}
        self.row_tails = {row: tails[row] for row in rows if row in tails}
        if self.on_change is not None:
            self.on_change(self)


def last_turn(
    tokenizer: Tokenizer,
    completion_id: str,
    row_index: int,
    prompt_ids: list[int],
    completion_ids: list[int],
    conversation: int = 0,
    asked: tuple[str, list[Any] | None, list[Any] | None] = ("chat", None, None),
) -> LastTurn:
    """``asked``: its request's surface, messages and tools."""
    text = tokenizer.decode(prompt_ids + completion_ids, skip_special_tokens=False)
    surface, messages, tools = asked
    return LastTurn(
        completion_id,
        row_index,
        prompt_ids,
        completion_ids,
        text,
        conversation,
        surface,
        messages,
        tools,
    )


def opening_length(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> int:
    """How many tokens of a conversation's first prompt are its *opening*: up to the last
    special token (where the chat template writes the header of the answer it asks for: the
    assistant's ``<|im_start|>``), so that a later prompt that renders the same first messages
    and then the answer (re-tokenized, say) still begins with it token for token. A prompt with
    no special token after some text (a plain-text prompt) opens with all of it but its last
    token (which may merge with what follows)."""
    seen_text = False
    cut = None
    for index, token in enumerate(prompt_ids):
        if _is_special(tokenizer, token):
            if seen_text:
                cut = index
        else:
            seen_text = True
    if cut is not None:
        return cut
    return max(len(prompt_ids) - 1, 1)


@lru_cache(maxsize=65536)
def _is_special(tokenizer: Tokenizer, token: int) -> bool:
    """A token that decoding leaves out."""
    return tokenizer.decode([token]) == "" and tokenizer.token_text(token) != ""


def kept_turns(latest: list[Turn], earlier: list[Turn]) -> list[Turn]:
    """What a conversation's next prompt may continue, read back from the store as
    ``recording.next_last`` kept it: its latest request's turns; the answers of the attempts
    that request retried (the requests just before it, of the same prompt ids), latest request
    first, at most ``MAX_RETRIED_KEPT``; the turn the attempts continued (of the request before
    them, the choice whose tokens the prompt extends). ``earlier``: the conversation's turns
    before ``latest``, latest first."""
    prompt = latest[0].prompt_ids
    asked = latest[0]
    attempts: list[list[Turn]] = []  # the retried requests' turns, latest request first
    rest = iter(earlier)
    continued = None  # the latest turn of the request before the attempts
    for turn in rest:
        if not asks_the_same(turn, asked):
            continued = turn
            break
        if attempts and attempts[-1][0].request_id == turn.request_id:
            attempts[-1].insert(0, turn)  # read latest first: a request's choices in order
        else:
            attempts.append([turn])
    retried = [turn for request in attempts for turn in request][:MAX_RETRIED_KEPT]
    if continued is None:
        return [*latest, *retried]
    request = continued.request_id
    before = [continued, *takewhile(lambda turn: turn.request_id == request, rest)]
    ids = unpack_ints(prompt)
    for turn in reversed(before):  # that request's choices in order
        tokens = unpack_ints(turn.prompt_ids) + unpack_ints(turn.completion_ids)
        if len(ids) > len(tokens) and ids[: len(tokens)] == tokens:
            return [*latest, *retried, turn]
    return [*latest, *retried]


class SessionRegistry:
    """Sessions' states by id, at most ``budget_bytes`` of them (``SessionState.nbytes``)."""

    def __init__(
        self, sessionmaker: Sessionmaker, tokenizer: Tokenizer, budget_bytes: int = 256 * MB
    ) -> None:
        self._sessionmaker = sessionmaker
        self._tokenizer = tokenizer
        self._states: ByteLRU[str, SessionState] = ByteLRU(
            budget_bytes, size_of=lambda state: state.nbytes, on_evict=self._evicted
        )
        # Dropped states that requests may still hold: while one does, it is the session's.
        self._held: weakref.WeakValueDictionary[str, SessionState] = weakref.WeakValueDictionary()

    @property
    def nbytes(self) -> int:
        return self._states.nbytes

    def __len__(self) -> int:
        return len(self._states)

    async def get(self, session_id: str) -> SessionState | None:
        state = self._states.get(session_id)
        if state is not None:
            return state
        state = self._held.pop(session_id, None)
        if state is None:
            state = await self._load(session_id)
            if state is None:
                return None
            racing = self._states.get(session_id) or self._held.pop(session_id, None)
            if racing is not None:  # another request loaded it meanwhile: one state
                return racing
        state.on_change = self._changed
        self._states.put(session_id, state)
        return state

    def forget(self, session_id: str) -> None:
        """Drop what is kept of the session: its next request reloads it from the store."""
        state = self._states.pop(session_id) or self._held.pop(session_id, None)
        if state is not None:
            state.on_change = None

    def set_status(self, session_id: str, status: str) -> None:
        """A session that takes no more turns needs nothing kept: it is dropped (its state
        told first, for a request that holds it)."""
        state = self._states.peek(session_id) or self._held.get(session_id)
        if state is not None:
            state.status = status
            if status != "open":
                self.forget(session_id)

    def _changed(self, state: SessionState) -> None:
        self._states.resize(state.id)

    def _evicted(self, session_id: str, state: SessionState) -> None:
        self._held[session_id] = state

    async def _load(self, session_id: str) -> SessionState | None:
        async with self._sessionmaker() as db:
            session = await store_sessions.get_session(db, session_id)
            if session is None:
                return None
            state = SessionState(
                session.id,
                session.run_id,
                session.status,
                engine=session.engine,
                production=session.production,
            )
            recent = await store_turns.recent_conversations(db, session_id, MAX_CONVERSATIONS)
            top_turn = await store_turns.last_turn_index(db, session_id)
            top_row = await store_turns.last_row_index(db, session_id)
        if top_turn is None:
            return state
        state.next_turn = int(top_turn) + 1
        state.next_row = int(top_row or 0) + 1
        known = [ends.conversation + 1 for ends in recent]
        state.next_conversation = max([int(session.conversations or 0), *known])
        conversations = []
        for ends in recent:  # least recently active first
            turns = [self._from_turn(turn) for turn in kept_turns(ends.last, ends.earlier)]
            first_prompt = unpack_ints(ends.first.prompt_ids)
            opening = opening_length(self._tokenizer, first_prompt)
            conversations.append(Conversation(ends.conversation, opening, turns))
        rows = {turn.row_index for c in conversations for turn in c.last}
        async with self._sessionmaker() as db:
            tails = await store_turns.row_tails(db, session_id, rows)
        for conversation in conversations:
            state.remember(conversation, tails)
        return state

    def _from_turn(self, turn: Turn) -> LastTurn:
        return last_turn(
            self._tokenizer,
            turn.completion_id,
            turn.row_index,
            unpack_ints(turn.prompt_ids),
            unpack_ints(turn.completion_ids),
            turn.conversation,
            (turn.surface, turn.messages, turn.tools),
        )
