"""Alternatives: which turns of a session the session did not go on from, and how many requests
were retried (server.store.rows).

Sessions are built the way ``server.proxy.recording`` records them: a request's choices get
consecutive turn indexes; the first choice of a request that continues a choice of an earlier
request shares that choice's row and extends it (its prompt is that choice's prompt + completion
+ new tokens); every other choice opens a row. A retry asks again with the same prompt. Examples
first, then properties over random sessions of requests with 1 to 4 choices, retries (the agent
going on from the last attempt or an earlier one) and breaks.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from server.store.rows import TurnTokens, alternatives, asks_the_same, assemble_rows, retries


@dataclass
class Recorder:
    """A session's turns, recorded as the proxy records them."""

    turns: list[TurnTokens] = field(default_factory=list)
    requests: list[list[TurnTokens]] = field(default_factory=list)
    next_row: int = 0

    def request(
        self, ask: str, n: int = 1, continues: int | None = None, of: int = -1
    ) -> list[str]:
        """A chat request with the user message ``ask`` and ``n`` choices; ``continues`` is the
        choice of request ``of`` (the previous one unless told) it continues. Returns the
        completion ids."""
        request_id = f"req{len(self.requests)}"
        messages = [{"role": "user", "content": ask}]
        continued_row = None
        prompt_ids = [1000 + ord(letter) for letter in ask]
        if continues is not None:
            went_on = self.requests[of][continues]
            continued_row = went_on.row_index
            prompt_ids = went_on.prompt_ids + went_on.completion_ids + prompt_ids
        made = []
        for choice in range(n):
            if choice == 0 and continued_row is not None:
                row, extends = continued_row, True
            else:
                row, extends = self.next_row, False
                self.next_row += 1
            made.append(
                TurnTokens(
                    completion_id=f"{request_id}-{choice}",
                    request_id=request_id,
                    turn_index=len(self.turns) + choice,
                    row_index=row,
                    extends_previous=extends,
                    messages=messages,
                    tools=None,
                    prompt_ids=prompt_ids,
                    completion_ids=[len(self.turns) + choice],
                    logprobs=[-0.1],
                    versions=[0],
                    temperature=1.0,
                )
            )
        self.turns += made
        self.requests.append(made)
        return [turn.completion_id for turn in made]

    def retry(self, n: int = 1) -> list[str]:
        """The previous request again (same messages, no tools): a retry."""
        previous = self.requests[-1][0]
        request_id = f"req{len(self.requests)}"
        made = []
        for choice in range(n):
            made.append(
                TurnTokens(
                    completion_id=f"{request_id}-{choice}",
                    request_id=request_id,
                    turn_index=len(self.turns) + choice,
                    row_index=self.next_row,
                    extends_previous=False,
                    messages=list(previous.messages or []),  # equal, not the same object
                    tools=previous.tools,
                    prompt_ids=list(previous.prompt_ids),
                    completion_ids=[len(self.turns) + choice],
                    logprobs=[-0.2],
                    versions=[0],
                )
            )
            self.next_row += 1
        self.turns += made
        self.requests.append(made)
        return [turn.completion_id for turn in made]


# --------------------------------------------------------------------------------------------
# examples


def test_n3_continued_by_choice_2_keeps_choice_2():
    session = Recorder()
    first = session.request("q", n=3)
    (second,) = session.request("q2", continues=2)
    assert alternatives(session.turns) == {first[0], first[1]}
    assert second not in alternatives(session.turns)


def test_a_retried_request_is_all_alternatives():
    session = Recorder()
    first = session.request("q", n=2)
    (again,) = session.retry()
    session.request("next", continues=0)
    assert alternatives(session.turns) == set(first)
    assert again not in alternatives(session.turns)


def test_a_retry_of_a_retry_keeps_only_the_last_attempt():
    session = Recorder()
    first = session.request("q")
    second = session.retry(n=2)
    third = session.retry(n=2)
    session.request("next", continues=1)
    assert alternatives(session.turns) == {*first, *second, third[0]}


def test_a_break_after_n_choices_keeps_choice_0():
    session = Recorder()
    first = session.request("q", n=3)
    session.request("unrelated")  # a break: it continues no choice
    assert alternatives(session.turns) == {first[1], first[2]}


def test_the_last_request_keeps_choice_0():
    session = Recorder()
    session.request("q")
    last = session.request("q2", n=3, continues=0)
    assert alternatives(session.turns) == {last[1], last[2]}


def test_a_single_choice_chain_has_no_alternatives():
    session = Recorder()
    session.request("a")
    session.request("b", continues=0)
    session.request("c", continues=0)
    session.request("d")  # a break
    assert alternatives(session.turns) == set()


def test_a_retried_continuation_leaves_the_path_through_the_retry():
    session = Recorder()
    (first,) = session.request("a")
    (continued,) = session.request("b", continues=0)
    (retried,) = session.retry()
    assert alternatives(session.turns) == {continued}
    assert first not in alternatives(session.turns) and retried not in alternatives(session.turns)


def asked(messages=None, tools=None, prompt_ids=(1,), surface="chat") -> TurnTokens:
    """A turn of a request that asked ``messages`` and ``tools`` (None: a prompt of ids)."""
    return TurnTokens(
        completion_id="c",
        request_id="r",
        turn_index=0,
        row_index=0,
        extends_previous=False,
        messages=messages,
        tools=tools,
        prompt_ids=list(prompt_ids),
        completion_ids=[3],
        logprobs=[-0.1],
        versions=[0],
        surface=surface,
    )


def test_requests_ask_the_same_by_prompt_ids_and_chat_by_its_messages_too():
    messages = [{"role": "user", "content": "hi"}]
    longer = [*messages, {"role": "assistant", "content": "hello"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert asks_the_same(asked(messages, prompt_ids=[1]), asked(messages, prompt_ids=[2]))
    assert not asks_the_same(asked(messages, prompt_ids=[1]), asked(messages, tools, [2]))
    assert not asks_the_same(asked(messages, prompt_ids=[1]), asked(longer, prompt_ids=[2]))
    assert asks_the_same(asked(prompt_ids=[1, 2]), asked(prompt_ids=[1, 2]))
    assert not asks_the_same(asked(prompt_ids=[1, 2]), asked(prompt_ids=[1, 3]))
    # The same prompt through another surface is the same request.
    assert asks_the_same(asked(messages, prompt_ids=[1]), asked(None, prompt_ids=[1]))
    # Messages of other surfaces need not hold the whole conversation (the Responses API's
    # previous_response_id): only their prompt ids count.
    new_input = [{"type": "message", "role": "user", "content": "go on"}]
    assert not asks_the_same(
        asked(new_input, prompt_ids=[1, 5], surface="responses"),
        asked(new_input, prompt_ids=[2, 5], surface="responses"),
    )


def reference_same(first: TurnTokens, other: TurnTokens) -> bool:
    """The reference: equal prompt ids, or two chat requests with equal messages and tools
    (compared as canonical JSON)."""
    if first.prompt_ids == other.prompt_ids:
        return True
    chats = [t for t in (first, other) if t.surface == "chat" and t.messages is not None]
    return (
        len(chats) == 2
        and len({json.dumps([t.messages, t.tools], sort_keys=True) for t in chats}) == 1
    )


TEXT = st.text(alphabet="ab", max_size=2)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT}),
    max_size=3,
)
TOOLS = st.none() | st.lists(st.fixed_dictionaries({"name": TEXT}), max_size=2)
ASKED = st.builds(
    asked,
    st.none() | MESSAGES,
    TOOLS,
    st.lists(st.integers(0, 2), min_size=1, max_size=3),
    st.sampled_from(["chat", "completions", "responses", "messages"]),
)


@settings(max_examples=500, deadline=None)
@given(ASKED, ASKED)
def test_asking_the_same_follows_the_reference(first, other):
    assert asks_the_same(first, other) == reference_same(first, other)
    assert asks_the_same(first, other) == asks_the_same(other, first)
    assert asks_the_same(first, first)


def test_the_agent_going_on_from_an_earlier_attempt_keeps_that_one():
    session = Recorder()
    session.request("q")
    (again,) = session.retry()  # the first answer came late, and the agent used it
    session.request("next", continues=0, of=0)
    assert alternatives(session.turns) == {again}
    assert retries(session.turns) == 1


def test_asking_again_after_going_on_is_no_retry():
    session = Recorder()
    session.request("q")
    session.request("next", continues=0)
    session.request("q")  # the same prompt as the first request: the agent started over
    assert alternatives(session.turns) == set()
    assert retries(session.turns) == 0


def test_retries_count_the_attempts_the_session_did_not_go_on_from():
    session = Recorder()
    session.request("q", n=2)
    session.retry()
    session.retry(n=3)
    session.request("next", continues=2)
    (last,) = session.request("more", continues=0)
    session.retry()
    assert retries(session.turns) == 3
    assert last in alternatives(session.turns)


def test_rows_flag_their_alternatives():
    session = Recorder()
    first = session.request("q", n=2)
    session.request("q2", continues=1)
    flags = {
        turn["completion_id"]: turn["alternative"]
        for row in assemble_rows(session.turns)
        for turn in row.turns
    }
    assert flags == {first[0]: True, first[1]: False, "req1-0": False}


# --------------------------------------------------------------------------------------------
# properties over random sessions

ASKS = ["a", "b", "c"]  # few, so that a request may ask what an earlier (not the last) one did


@st.composite
def sessions(draw) -> tuple[Recorder, list[str]]:
    """A random session and, per request, how it relates to the one before it: "first",
    "retry", "continue:<choice>" or "break"."""
    session, kinds = Recorder(), []
    session.request(draw(st.sampled_from(ASKS)), n=draw(st.integers(1, 4)))
    kinds.append("first")
    for _ in range(draw(st.integers(0, 7))):
        n = draw(st.integers(1, 4))
        kind = draw(st.sampled_from(["retry", "continue", "break"]))
        previous_ask = session.requests[-1][0].messages
        others = [ask for ask in ASKS if [{"role": "user", "content": ask}] != previous_ask]
        if kind == "retry":
            session.retry(n)
            kinds.append("retry")
        elif kind == "continue":
            choice = draw(st.integers(0, len(session.requests[-1]) - 1))
            session.request(draw(st.sampled_from(others)), n=n, continues=choice)
            kinds.append(f"continue:{choice}")
        else:
            session.request(draw(st.sampled_from(others)), n=n)
            kinds.append("break")
    return session, kinds


def on_path(session: Recorder) -> list[list[str]]:
    """Per request, its turns that are not alternatives."""
    off = alternatives(session.turns)
    return [
        [t.completion_id for t in request if t.completion_id not in off]
        for request in session.requests
    ]


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_exactly_one_turn_of_each_request_not_retried_is_on_the_path(drawn):
    session, kinds = drawn
    kept = on_path(session)
    for index, request_kept in enumerate(kept):
        retried = index + 1 < len(kinds) and kinds[index + 1] == "retry"
        assert len(request_kept) == (0 if retried else 1), (index, kinds)


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_a_continued_choice_is_on_the_path_and_an_uncontinued_request_keeps_choice_0(drawn):
    session, kinds = drawn
    kept = on_path(session)
    for index, request in enumerate(session.requests):
        following = kinds[index + 1] if index + 1 < len(kinds) else "last"
        if following.startswith("continue:"):
            choice = int(following.split(":")[1])
            assert kept[index] == [request[choice].completion_id]
        elif following in ("break", "last"):
            assert kept[index] == [request[0].completion_id]


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_alternatives_count_every_turn_but_one_per_request_not_retried(drawn):
    session, kinds = drawn
    not_retried = sum(
        1 for index in range(len(kinds)) if index + 1 == len(kinds) or kinds[index + 1] != "retry"
    )
    assert len(alternatives(session.turns)) == len(session.turns) - not_retried


@settings(max_examples=200, deadline=None)
@given(sessions(), st.randoms(use_true_random=False))
def test_alternatives_do_not_depend_on_the_order_turns_are_given_in(drawn, rng: random.Random):
    session, _ = drawn
    shuffled = list(session.turns)
    rng.shuffle(shuffled)
    assert alternatives(shuffled) == alternatives(session.turns)


@settings(max_examples=200, deadline=None)
@given(sessions())
def test_rows_carry_every_turn_once_with_its_flag(drawn):
    session, _ = drawn
    off = alternatives(session.turns)
    carried = [turn for row in assemble_rows(session.turns) for turn in row.turns]
    assert sorted(t["completion_id"] for t in carried) == sorted(
        t.completion_id for t in session.turns
    )
    assert all(t["alternative"] == (t["completion_id"] in off) for t in carried)
    assert all(t["temperature"] in (1.0, None) for t in carried)


@dataclass
class Group:
    """A request and its retries: their indexes in the session, and the turn the next group goes
    on from (None: it breaks, or there is none)."""

    requests: list[int]
    went_on: tuple[int, int] | None = None  # (request index, choice)


@st.composite
def retried_sessions(draw) -> tuple[Recorder, list[Group]]:
    """A random session of attempt groups: each a request (a break, or a continuation of a turn
    of any attempt of the group before) then 0 to 2 retries."""
    session, groups = Recorder(), []
    previous_ask = None
    for _ in range(draw(st.integers(1, 5))):
        ask = draw(st.sampled_from([a for a in ASKS if a != previous_ask]))
        n = draw(st.integers(1, 3))
        if groups and draw(st.booleans()):
            attempt = draw(st.sampled_from(groups[-1].requests))
            choice = draw(st.integers(0, len(session.requests[attempt]) - 1))
            groups[-1].went_on = (attempt, choice)
            session.request(ask, n=n, continues=choice, of=attempt)
        else:
            session.request(ask, n=n)
        group = Group([len(session.requests) - 1])
        for _ in range(draw(st.integers(0, 2))):
            session.retry(draw(st.integers(1, 3)))
            group.requests.append(len(session.requests) - 1)
        groups.append(group)
        previous_ask = ask
    return session, groups


@settings(max_examples=300, deadline=None)
@given(retried_sessions())
def test_each_attempt_group_keeps_the_turn_gone_on_from_else_its_last_attempts_choice_0(drawn):
    session, groups = drawn
    off = alternatives(session.turns)
    for group in groups:
        turns = [t.completion_id for index in group.requests for t in session.requests[index]]
        attempt, choice = group.went_on or (group.requests[-1], 0)
        assert [t for t in turns if t not in off] == [
            session.requests[attempt][choice].completion_id
        ]


@settings(max_examples=300, deadline=None)
@given(retried_sessions())
def test_retries_count_every_attempt_but_the_one_gone_on_from(drawn):
    session, groups = drawn
    assert retries(session.turns) == sum(len(group.requests) - 1 for group in groups)
