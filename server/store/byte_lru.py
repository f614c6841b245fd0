"""A mapping bounded by the memory its values take: the least recently used entries go first.

What the server keeps in memory of the store (sessions' last turns, callers' keys, runs'
configs) is held in one, so that its memory is a setting, not a function of how many sessions
or keys it has seen. What an entry costs is measured by the caller's ``size_of`` (:func:`nbytes`
for plain data); what is evicted is read from the store again when next needed, by the caller.
It knows nothing of what it holds.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

MB = 1024 * 1024
# A Python int in a list: its 8-byte slot and its object (28 bytes, allocated in 32); token ids
# are above the small ints Python shares. Measured with tracemalloc: ~40 bytes each.
INT_IN_LIST = 40


def nbytes(value: Any) -> int:
    """What ``value`` (plain data: str, bytes, numbers, lists, tuples, dicts, and dataclass-like
    objects through their ``__dict__``) takes in memory, in bytes, counting shared objects each
    time they appear (an overestimate), but for None, booleans and dicts' str keys (shared). A
    list of ints costs :data:`INT_IN_LIST` per item."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list) and item and isinstance(item[0], int):
            total += sys.getsizeof(item) + INT_IN_LIST * len(item)
            continue
        if item is None or item is True or item is False:
            continue  # one object, shared by everyone
        total += sys.getsizeof(item)
        if isinstance(item, str | bytes | int | float):
            continue
        if isinstance(item, dict):  # its str keys are shared (interned, or memoized by json)
            stack.extend(key for key in item if not isinstance(key, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return total


class ByteLRU(Generic[K, V]):
    """At most ``budget_bytes`` of values (as ``size_of`` measures them), least recently used
    evicted first (``on_evict`` is told). An entry larger than the whole budget is kept alone
    until the next one comes: the request that made it still gets its answer."""

    def __init__(
        self,
        budget_bytes: int,
        size_of: Callable[[V], int] = nbytes,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._on_evict = on_evict
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def peek(self, key: K) -> V | None:
        """The value, leaving the order as it is."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V) -> None:
        self.pop(key)
        size = self._size_of(value)
        self._entries[key] = (value, size)
        self.nbytes += size
        self._evict()

    def resize(self, key: K) -> None:
        """Measure ``key``'s value again (it changed in place), evicting others if need be."""
        entry = self._entries.get(key)
        if entry is None:
            return
        size = self._size_of(entry[0])
        self._entries[key] = (entry[0], size)
        self.nbytes += size - entry[1]
        self._evict()

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        return entry[0]

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and len(self._entries) > 1:
            key, (value, size) = self._entries.popitem(last=False)
            self.nbytes -= size
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(key, value)
