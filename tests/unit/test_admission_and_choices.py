"""Admission (the staleness bound), stop-string handling in streamed text, engine bodies."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.errors import StalenessBound
from server.proxy.generation import Completion, SamplingRequest, engine_body, parse_version
from server.proxy.outputs import TextStreamer, final_text
from server.rl.admission import Admission, Held, admits
from server.store.run_config import RunConfig
from server.text.tokenization import Tokenizer

NOW = datetime(2026, 11, 26, tzinfo=UTC)


def held(
    *rows: tuple[str | None, str | None, int], group_size: int = 1, age_s: float = 0.0
) -> Held:
    """Held sessions whose newest per group is ``age_s`` old, under a group timeout of 600 s."""
    newest = NOW - timedelta(seconds=age_s)
    return Held.of([(*row, newest) for row in rows], group_size, NOW, 600.0)


@pytest.mark.parametrize(
    ("sessions", "eta", "expected"),
    [(0, 0, True), (3, 0, True), (4, 0, False), (11, 2, True), (12, 2, False)],
)
def test_admits_up_to_eta_plus_one_batches_of_places(sessions, eta, expected):
    config = RunConfig(batch_size=4, max_staleness=eta)
    assert config.admission_limit() == (eta + 1) * 4
    assert admits(held((None, None, sessions)), None, config) is expected


def test_no_batch_size_admits_everything():
    assert admits(held((None, None, 10**9)), None, RunConfig())


def test_a_group_is_admitted_as_a_unit():
    """The first member of a group takes group_size places; the others come in at once, even
    when the run is full; a new group waits for room for all of it."""
    config = RunConfig(batch_size=4, max_staleness=1, group_size=4)  # 8 places
    full = held(("g1", None, 1), ("g2", None, 3), group_size=4)
    assert full.places(4) == 8
    assert full.cost(("group", "g1"), 4) == 0 and admits(full, ("group", "g1"), config)
    assert full.cost(("group", "g3"), 4) == 4 and not admits(full, ("group", "g3"), config)
    half = held(("g1", None, 4), group_size=4)
    assert half.places(4) == 4 and admits(half, ("group", "g3"), config)
    # a fifth member of a whole group takes a place of its own
    assert half.cost(("group", "g1"), 4) == 1


def test_task_ids_form_groups_only_under_a_group_size():
    rows = (None, "task", 3), (None, None, 2)
    assert held(*rows, group_size=4).places(4) == 4 + 2
    assert held(*rows, group_size=1).places(1) == 5
    assert held(*rows, group_size=4).groups == {("task", "task"): 3}


def test_a_group_gathers_until_its_group_timeout_then_holds_one_place_per_member():
    """Past group_timeout_s a claim resolves a group as it is, and its late members form a
    group of their own: places held for members that never came must not block the run (three
    such remnants of groups of 8 used to hold every place while the trainer waited)."""
    config = RunConfig(batch_size=8, max_staleness=2, group_size=8)  # 24 places
    rows = ("a", None, 2), ("b", None, 3), ("c", None, 2)
    young, old = held(*rows, group_size=8, age_s=10), held(*rows, group_size=8, age_s=601)
    assert young.places(8) == 24 and not admits(young, None, config)
    assert old.places(8) == 7 and admits(old, ("group", "d"), config)
    # a newcomer starts the group gathering again, and pays for the places that takes
    assert old.cost(("group", "a"), 8) == 8 - 2 and old.cost(("group", "d"), 8) == 8
    forever = Held.of([("a", None, 2, NOW - timedelta(days=9))], 8, NOW, None)
    assert forever.places(8) == 8  # group_timeout_s None: a group waits for all of itself


def test_a_group_larger_than_the_limit_is_not_shut_out():
    config = RunConfig(batch_size=2, max_staleness=0, group_size=4)  # 2 places, groups of 4
    assert admits(held(group_size=4), ("group", "g"), config)
    assert not admits(held(("h", None, 4), group_size=4), ("group", "g"), config)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 9), max_size=8),
    keyless=st.integers(0, 20),
    group_size=st.integers(1, 8),
)
def test_places_count_every_group_at_least_group_size(counts, keyless, group_size):
    rows = [(f"g{i}", None, n, NOW) for i, n in enumerate(counts)] + [(None, None, keyless, NOW)]
    places = Held.of(rows, group_size, NOW, 600.0).places(group_size)
    assert places == keyless + sum(max(n, group_size) for n in counts)
    assert places >= keyless + sum(counts)


def test_waiting_then_admitted_when_notified():
    async def scenario():
        admission = Admission()
        room = {"open": False}

        async def check():
            return room["open"], RunConfig(batch_size=1, admission_wait_s=10)

        waiter = asyncio.create_task(admission.wait_for_room(check))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        room["open"] = True
        started = time.monotonic()
        await admission.notify()
        await asyncio.wait_for(waiter, 2)
        return time.monotonic() - started, admission.waits

    elapsed, waits = asyncio.run(scenario())
    assert waits == 1 and elapsed < 1.0


def test_refused_with_retry_after_when_the_wait_runs_out():
    async def scenario():
        async def check():
            return False, RunConfig(batch_size=1, admission_wait_s=0.2)

        await Admission().wait_for_room(check)

    with pytest.raises(StalenessBound) as refused:
        asyncio.run(scenario())
    assert refused.value.status == 429
    assert int(refused.value.headers["Retry-After"]) >= 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_streamed_text_never_shows_a_stop_string(tokenizer):
    text = "The answer is 42. Observation: more"
    ids = tokenizer.encode(text)
    stop = "Observation:"
    cut = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    completion = Completion(prompt_ids=[1], ids=ids[: cut + 1])
    completion.finish_reason = {"type": "stop", "matched": stop}
    streamer, streamed = TextStreamer(tokenizer, (stop,)), ""
    for token in completion.ids:
        streamed += streamer.push([token])
        assert "Obs" not in streamed
    streamed += streamer.finish(completion)
    assert streamed == final_text(tokenizer, completion) == "The answer is 42. "


def test_final_text_drops_a_matched_stop_token(tokenizer):
    ids = tokenizer.encode("ok") + tokenizer.encode("<tool_call>")
    completion = Completion(prompt_ids=[1], ids=ids)
    completion.finish_reason = {"type": "stop", "matched": ids[-1]}
    assert final_text(tokenizer, completion) == "ok"


def test_engine_body_resumes_with_the_tokens_so_far():
    request = SamplingRequest(
        prompt_ids=[1, 2], max_tokens=10, temperature=0.5, stop=("x",), seed=7, top_logprobs=2
    )
    body = engine_body(request, [3, 4, 5], "rid-1")
    assert body["input_ids"] == [1, 2, 3, 4, 5]
    assert body["sampling_params"] == {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "skip_special_tokens": False,
        "stop": ["x"],
        "sampling_seed": 7,
    }
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert body["rid"] == "rid-1"


@pytest.mark.parametrize(
    ("version", "expected"), [("0", 0), ("17", 17), ("default", 0), ("step-12", 12)]
)
def test_parse_version(version, expected):
    assert parse_version(version) == expected


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(["a", "b", "c", None])),
        st.tuples(st.just("leave"), st.integers(0, 50)),  # trained or dropped: the i-th held
        st.tuples(st.just("wait"), st.sampled_from([1.0, 100.0, 400.0, 700.0])),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    batch_size=st.integers(1, 6),
    eta=st.integers(0, 2),
    group_size=st.integers(1, 4),
    timeout_s=st.sampled_from([None, 300.0, 600.0]),
)
def test_only_an_admission_takes_places_and_never_past_the_limit(
    ops, batch_size, eta, group_size, timeout_s
):
    """The pure rule over random admissions, departures (a step trained the session, or it
    was dropped) and the passing of time: places rise only by an admission, by exactly its
    cost; time and departures never raise them (groups stop gathering, never start again by
    themselves); and they never pass max((eta + 1) * batch_size, group_size)."""
    config = RunConfig(
        batch_size=batch_size, max_staleness=eta, group_size=group_size, group_timeout_s=timeout_s
    )
    limit = max((eta + 1) * batch_size, group_size)
    now = NOW
    sessions: list[tuple[str | None, datetime]] = []  # (group id, created_at) of held sessions

    def held_now() -> Held:
        rows: dict[str | None, list[datetime]] = {}
        for group, created in sessions:
            rows.setdefault(group, []).append(created)
        table = [
            (group, None, len(created), max(created))
            for group, created in rows.items()
            if group is not None
        ]
        table += [(None, None, len(rows.get(None, [])), now)]
        return Held.of(table, group_size, now, timeout_s)

    for op, arg in ops:
        before = held_now()
        places = before.places(group_size)
        if op == "admit":
            key = None if arg is None else ("group", arg)
            if admits(before, key, config):
                sessions.append((arg, now))
                assert held_now().places(group_size) == places + before.cost(key, group_size)
        elif op == "leave" and sessions:
            sessions.pop(arg % len(sessions))
            assert held_now().places(group_size) <= places
        elif op == "wait":
            now += timedelta(seconds=arg)
            assert held_now().places(group_size) <= places
        assert held_now().places(group_size) <= limit
