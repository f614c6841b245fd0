"""Conversations within a session (server.proxy.recording): a request that continues no
conversation of its session starts one (its own row, no break); a break is a request that
changed a conversation's history; a retry stays a retry with side requests in between. Driven
through the real path: the tiny model's chat template renders the agent's messages,
``prompts.splice`` builds the prompt from the session's state, ``recording.record`` places it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.dashboard.transcript import transcript
from server.proxy import prompts
from server.proxy.generation import Completion
from server.proxy.recording import RequestLog, Served, record
from server.proxy.session_cache import (
    MAX_CONVERSATIONS,
    MAX_RETRIED_KEPT,
    SessionState,
    opening_length,
)
from server.store.rows import TurnTokens, alternatives, retries
from server.store.turns import TurnRecord
from server.text.tokenization import Tokenizer
from tests.support import turn_out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


class Store:
    """Stands in for the turn writer: keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[TurnRecord] = []

    async def write(self, records: list[TurnRecord]) -> None:
        self.records.extend(records)


@dataclass
class Session:
    """A session's state and what was recorded, and the agent's requests so far."""

    tokenizer: Tokenizer
    state: SessionState = field(default_factory=lambda: SessionState("s", "r", "open"))
    store: Store = field(default_factory=Store)
    sent: int = 0

    def send(
        self, messages: list[dict], n: int = 1, ids: list[int] | None = None
    ) -> list[TurnRecord]:
        """One request: the prompt spliced from the session's state (or ``ids``, as if the
        messages had tokenized otherwise), ``n`` answers."""
        self.sent += 1
        text = self.tokenizer.render(messages)
        prompt = prompts.splice(self.tokenizer, text, self.state.last)
        if ids is not None:
            prompt = prompts.Prompt(ids, None)
        served = []
        for choice in range(n):
            ids = [*self.tokenizer.encode(f"answer {self.sent}.{choice}"), self.end]
            completion = Completion(prompt.ids, ids, [-0.5] * len(ids), versions=[0] * len(ids))
            served.append(Served(f"c{self.sent}.{choice}", completion, {}, "stop"))
        log = RequestLog(f"r{self.sent}", "chat", "tiny", messages, None, {})
        before = len(self.store.records)
        writer = cast(Any, self.store)
        asyncio.run(record(writer, self.tokenizer, self.state, prompt, served, log))
        return self.store.records[before:]

    @property
    def end(self) -> int:
        return self.tokenizer.encode("<|im_end|>")[0]

    def answer(self, turn: TurnRecord) -> dict:
        return {"role": "assistant", "content": f"answer {turn.completion_id[1:]}"}

    def tokens(self) -> list[TurnTokens]:
        return [
            TurnTokens(
                completion_id=r.completion_id,
                request_id=r.request_id,
                turn_index=r.turn_index,
                row_index=r.row_index,
                extends_previous=r.extends_previous,
                messages=r.messages,
                tools=r.tools,
                prompt_ids=r.prompt_ids,
                completion_ids=r.completion_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                conversation=r.conversation,
            )
            for r in self.store.records
        ]


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_a_title_request_between_turns_is_a_conversation_of_its_own(tokenizer):
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    (first,) = session.send(main)
    (title,) = session.send([system("Write a title."), user("Fix the bug.")])
    main += [session.answer(first), user("Go on.")]
    (second,) = session.send(main)

    assert (first.conversation, title.conversation, second.conversation) == (0, 1, 0)
    assert second.extends_previous and second.row_index == first.row_index
    assert title.new_conversation and not title.is_break and title.new_row
    assert not any(r.is_break for r in session.store.records)


def test_an_edited_history_breaks_its_conversation(tokenizer):
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    session.send(main)
    session.send([system("Summarize."), user("A long text.")])
    edited = [*main, {"role": "assistant", "content": "Something else."}, user("Go on.")]
    (second,) = session.send(edited)

    assert second.conversation == 0 and second.is_break and second.new_row
    assert not second.new_conversation


def test_a_compacted_history_under_the_same_system_prompt_starts_a_conversation(tokenizer):
    """An agent that compacts replaces its history with a summary as the first message: its
    opening differs, so it is a new conversation, not a break."""
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    (first,) = session.send(main)
    session.send([*main, session.answer(first), user("Summarize the conversation.")])
    (compacted,) = session.send([system("You are a coding agent."), user("Summary: a bug.")])

    assert compacted.conversation == 1 and compacted.new_conversation
    assert not any(r.is_break for r in session.store.records)


def test_a_retry_with_a_side_request_between_is_still_a_retry(tokenizer):
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    (first,) = session.send(main)
    session.send([system("Write a title."), user("Fix the bug.")])
    (again,) = session.send(main)

    assert again.conversation == 0 and again.new_row and not again.is_break
    tokens = session.tokens()
    assert retries(tokens) == 1 and alternatives(tokens) == {first.completion_id}


def test_the_same_messages_tokenized_otherwise_are_a_retry_everywhere(tokenizer):
    """One definition of a retry (``rows.asks_the_same``): a chat request whose messages and
    tools are the previous request's, its prompt ids not (the history was no longer spliced),
    is placed as a retry, not a break, and the rows, the retry counter and the dashboard's
    transcript agree: rows = conversations + breaks + retries + extra choices."""
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    (first,) = session.send(main)
    otherwise = [*first.prompt_ids, *tokenizer.encode(" ")]  # still begins with its opening
    (again,) = session.send(main, ids=otherwise)

    assert again.prompt_ids != first.prompt_ids
    assert again.conversation == 0 and again.new_row
    assert not again.is_break and not again.new_conversation
    records = session.store.records
    tokens = session.tokens()
    conversations = sum(r.new_conversation for r in records)
    breaks = sum(r.is_break for r in records)
    assert (conversations, breaks, retries(tokens)) == (1, 0, 1)
    assert sum(r.new_row for r in records) == conversations + breaks + retries(tokens)
    assert alternatives(tokens) == {first.completion_id}
    shown = [
        dataclasses.replace(
            turn_out(r.turn_index, surface="chat", model="tiny", messages=r.messages, response={}),
            completion_id=r.completion_id,
            request_id=r.request_id,
            row_index=r.row_index,
            extends_previous=r.extends_previous,
            conversation=r.conversation,
            prompt_ids=r.prompt_ids,
        )
        for r in records
    ]
    assert [t.kind for t in transcript(shown)] == ["conversation", "retry"]


def test_opening_ends_before_the_answer_header(tokenizer):
    text = tokenizer.render([system("S"), user("hi")])
    ids = tokenizer.encode(text)
    opening = tokenizer.decode(ids[: opening_length(tokenizer, ids)], skip_special_tokens=False)
    assert text == opening + "<|im_start|>assistant\n"
    plain = tokenizer.encode("Q: what? A:")
    assert opening_length(tokenizer, plain) == len(plain) - 1


def test_the_same_prompt_again_and_again_keeps_a_bounded_state(tokenizer):
    """Issue 27: every earlier attempt was kept and tried on each request."""
    session = Session(tokenizer)
    main = [system("You are a coding agent."), user("Fix the bug.")]
    for _ in range(3 * MAX_RETRIED_KEPT):
        session.send(main, n=2)
    (conversation,) = session.state.conversations.values()
    assert len(conversation.last) == 2 + MAX_RETRIED_KEPT
    assert len(session.state.row_tails) == len(conversation.last)
    assert sum(r.is_break for r in session.store.records) == 0
    # The agent goes on from the latest answer: it continues that row.
    latest = session.store.records[-2]
    (went_on,) = session.send([*main, session.answer(latest), user("Go on.")])
    assert went_on.extends_previous and went_on.row_index == latest.row_index


def test_a_session_remembers_a_bounded_number_of_conversations(tokenizer):
    session = Session(tokenizer)
    for index in range(MAX_CONVERSATIONS + 3):
        session.send([system(f"Side request {index}."), user("Go.")])
    assert len(session.state.conversations) == MAX_CONVERSATIONS
    assert session.state.next_conversation == MAX_CONVERSATIONS + 3


KINDS = ("continue", "side", "compact", "edit", "retry", "restart")


@given(
    st.lists(
        st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(1, 2)),
        max_size=12,
    )
)
@settings(max_examples=60, deadline=None)
def test_rows_are_conversations_plus_breaks_plus_retries(tokenizer, steps):
    """Random traffic over a few conversations: each request lands in the conversation the
    agent meant, breaks are exactly the history edits, and every row is a conversation's first,
    a break, a retry or another choice of a request."""
    session = Session(tokenizer)
    # The agent's view of each conversation: its first messages, the last request's messages,
    # and the history it would send next (the last request's messages + the answer it used).
    firsts: list[list[dict]] = []
    lasts: list[list[dict]] = []
    histories: list[list[dict]] = []
    expected = {"conversations": 0, "breaks": 0, "retries": 0, "choices": 0}

    def start(messages: list[dict], n: int) -> None:
        turns = session.send(messages, n)
        assert turns[0].new_conversation and turns[0].conversation == len(firsts)
        firsts.append(messages)
        lasts.append(messages)
        histories.append([*messages, session.answer(turns[0])])
        expected["conversations"] += 1
        expected["choices"] += n - 1

    start([system("main agent"), user("task")], 1)
    for number, (kind, pick, n) in enumerate(steps):
        k = pick % len(firsts)
        if kind == "side":
            start([system(f"side {number}"), user("task")], n)
            continue
        if kind == "compact":
            start([firsts[k][0], user(f"summary {number}")], n)
            continue
        if kind == "continue":
            messages = [*histories[k], user(f"more {number}")]
        elif kind == "edit":
            edited = {"role": "assistant", "content": f"edited {number}"}
            messages = [*firsts[k], edited, user(f"more {number}")]
        elif kind == "retry":
            messages = lasts[k]
        else:  # restart: the first messages again
            messages = firsts[k]
        turns = session.send(messages, n)
        head = turns[0]
        assert head.conversation == k
        retried = messages == lasts[k]
        assert head.is_break == (kind in ("edit", "restart") and not retried)
        assert head.new_row == (kind != "continue")
        assert not head.new_conversation
        expected["breaks"] += head.is_break
        expected["retries"] += retried
        expected["choices"] += n - 1
        lasts[k] = messages
        histories[k] = [*messages, session.answer(head)]

    records = session.store.records
    rows = sum(r.new_row for r in records)
    assert sum(r.new_conversation for r in records) == expected["conversations"]
    assert sum(r.is_break for r in records) == expected["breaks"]
    assert rows == sum(expected.values())
    assert len({r.row_index for r in records}) == rows
    assert retries(session.tokens()) == expected["retries"]
