"""Retention of a run's pinnable versions (``run_versions.evictions``), over random sequences of
publishes with random sizes and a random promoted version: it never evicts the current version,
the promoted one or version 0; what it keeps is within both bounds unless only protected versions
are left over them; it evicts the oldest first (every version kept is newer than every one
evicted, protected ones aside); each eviction names the bound it was for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.store.run_versions import Retention, evictions

MB = 2**20


@st.composite
def histories(draw):
    """A run's publishes, each applied as ``set_policy_version`` applies retention: the pinnable
    versions after each publish, the current and promoted versions, the bounds."""
    sizes = draw(st.lists(st.none() | st.integers(0, 50 * MB), min_size=1, max_size=30))
    retention = Retention(draw(st.integers(1, 8)), draw(st.sampled_from([0, 10 * MB, 60 * MB])))
    promoted = draw(st.none() | st.integers(0, len(sizes)))
    return sizes, retention, promoted


@given(histories())
def test_retention_keeps_protected_versions_within_bounds_oldest_evicted_first(history):
    sizes, retention, promoted = history
    pinnable: list[tuple[int, int | None]] = []
    evicted: dict[int, str] = {}
    for version, size in enumerate(sizes, 1):
        pinnable.append((version, size))
        keep = {0, version} | ({promoted} if promoted is not None else set())
        chosen = evictions(pinnable, keep, retention)
        assert not keep & set(chosen)
        evicted |= chosen
        pinnable = [(v, s) for v, s in pinnable if v not in chosen]
        free = [v for v, _ in pinnable if v not in keep]
        assert len(pinnable) <= retention.kept or not free
        total = sum(s or 0 for _, s in pinnable)
        assert not retention.max_bytes or total <= retention.max_bytes or not free
        newest_evicted = max((v for v in evicted if v not in keep), default=0)
        assert all(v > newest_evicted for v in free)
    for reason in evicted.values():
        assert reason.split(":")[0] in ("versions_kept", "versions_max_mb")


def test_each_bound_names_itself():
    three = [(1, 5 * MB), (2, 5 * MB), (3, 5 * MB)]
    by_count = evictions(three, {3}, Retention(2))
    assert set(by_count) == {1} and by_count[1].startswith("versions_kept:")
    by_size = evictions(three, {3}, Retention(5, 8 * MB))
    assert set(by_size) == {1, 2} and by_size[1].startswith("versions_max_mb:")
    assert evictions(three, {1, 2, 3}, Retention(1, MB)) == {}  # protected, over both bounds
