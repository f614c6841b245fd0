"""The byte-bounded LRU under every cache of the proxy, held to a plain model of it, and its
measure of plain data held to what tracemalloc sees."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from server.store.byte_lru import ByteLRU, nbytes

BUDGET = 1000
KEYS = st.sampled_from("abcdefgh")


class AgainstAModel(RuleBasedStateMachine):
    """A list of (key, size) in order of use, evicted from the front while over the budget."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[str] = []
        self.cache: ByteLRU[str, list[int]] = ByteLRU(
            BUDGET, size_of=lambda v: v[0], on_evict=lambda k, _v: self.evicted.append(k)
        )
        self.model: list[tuple[str, int]] = []

    def _evict(self) -> None:
        while sum(size for _, size in self.model) > BUDGET and len(self.model) > 1:
            key, _ = self.model.pop(0)
            assert self.evicted.pop(0) == key
        assert self.evicted == []

    @rule(key=KEYS, size=st.integers(0, 1500))
    def put(self, key: str, size: int) -> None:
        self.cache.put(key, [size])
        self.model = [(k, s) for k, s in self.model if k != key] + [(key, size)]
        self._evict()

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        found = [(k, s) for k, s in self.model if k == key]
        value = self.cache.get(key)
        assert (value is None) == (not found)
        if found:
            assert value == [found[0][1]]
            self.model = [(k, s) for k, s in self.model if k != key] + found

    @rule(key=KEYS, size=st.integers(0, 1500))
    def grow_in_place(self, key: str, size: int) -> None:
        value = self.cache.peek(key)
        if value is None:
            return
        value[0] = size
        self.cache.resize(key)
        self.model = [(k, size if k == key else s) for k, s in self.model]
        self._evict()

    @rule(key=KEYS)
    def pop(self, key: str) -> None:
        self.cache.pop(key)
        self.model = [(k, s) for k, s in self.model if k != key]

    @invariant()
    def same_contents_and_bytes(self) -> None:
        assert [k for k, _ in self.model] == list(self.cache._entries)
        assert self.cache.nbytes == sum(size for _, size in self.model)
        assert self.cache.nbytes <= BUDGET or len(self.cache) == 1


TestAgainstAModel = AgainstAModel.TestCase
TestAgainstAModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def measured(make) -> int:
    """The bytes ``make()``'s result holds, as tracemalloc sees them."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        value = make()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert value is not None
    return after - before


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: [random.randrange(300, 150_000) for _ in range(20_000)], id="ids"),
        pytest.param(lambda: "héllo wörld, " * 5_000, id="text"),
        pytest.param(
            lambda: [
                {"role": "user", "content": f"message {i} " * 20, "name": None} for i in range(500)
            ],
            id="messages",
        ),
    ],
)
def test_the_measure_of_plain_data_is_within_a_quarter_of_what_it_takes(make) -> None:
    value = make()
    assert nbytes(value) == pytest.approx(measured(make), rel=0.25)


def test_a_single_entry_over_the_budget_is_kept_until_the_next() -> None:
    cache: ByteLRU[str, str] = ByteLRU(100)
    cache.put("big", "x" * 1000)
    assert cache.get("big") is not None
    cache.put("small", "y")
    assert "big" not in cache and cache.get("small") == "y"
