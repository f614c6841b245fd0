"""Alternatives: which turns of a session the session did not go on from (server.store.rows).

Sessions are built the way ``server.proxy.recording`` records them: a request's choices get
consecutive turn indexes; the first choice of a request that continues a choice of the previous
request shares that choice's row and extends it; every other choice opens a row. Examples first,
then properties over random sessions of requests with 1 to 4 choices, retries and breaks.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from server.store.rows import TurnTokens, alternatives, asks_the_same, assemble_rows


@dataclass
class Recorder:
    """A session's turns, recorded as the proxy records them."""

    turns: list[TurnTokens] = field(default_factory=list)
    requests: list[list[TurnTokens]] = field(default_factory=list)
    next_row: int = 0

    def request(self, ask: str, n: int = 1, continues: int | None = None) -> list[str]:
        """A chat request with the user message ``ask`` and ``n`` choices; ``continues`` is the
        choice of the previous request it continues. Returns the completion ids."""
        request_id = f"req{len(self.requests)}"
        messages = [{"role": "user", "content": ask}]
        continued_row = None
        if continues is not None:
            continued_row = self.requests[-1][continues].row_index
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
                    prompt_ids=[1, 2],
                    completion_ids=[3],
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
                    prompt_ids=[1, 2],
                    completion_ids=[4],
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


def asked(messages=None, tools=None, prompt_ids=(1,)) -> TurnTokens:
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
    )


def test_chat_and_token_prompts_are_compared_by_what_they_asked():
    messages = [{"role": "user", "content": "hi"}]
    longer = [*messages, {"role": "assistant", "content": "hello"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert asks_the_same(asked(messages, prompt_ids=[1]), asked(messages, prompt_ids=[2]))
    assert not asks_the_same(asked(messages), asked(messages, tools))
    assert not asks_the_same(asked(messages), asked(longer))
    assert asks_the_same(asked(prompt_ids=[1, 2]), asked(prompt_ids=[1, 2]))
    assert not asks_the_same(asked(prompt_ids=[1, 2]), asked(prompt_ids=[1, 3]))
    assert not asks_the_same(asked(messages, prompt_ids=[1]), asked(None, prompt_ids=[1]))
    assert not asks_the_same(asked([], prompt_ids=[1]), asked(None, prompt_ids=[1]))


def signature(turn: TurnTokens) -> str:
    """The reference: what the request asked, as canonical JSON (the rule's definition)."""
    if turn.messages is not None:
        return json.dumps(["chat", turn.messages, turn.tools], sort_keys=True)
    return json.dumps(["ids", turn.prompt_ids])


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
    st.lists(st.integers(0, 2), max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(ASKED, ASKED)
def test_asking_the_same_is_having_the_same_canonical_request(first, other):
    assert asks_the_same(first, other) == (signature(first) == signature(other))
    assert asks_the_same(first, other) == asks_the_same(other, first)
    assert asks_the_same(first, first)


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
