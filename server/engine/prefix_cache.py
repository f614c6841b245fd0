"""A bounded prefix cache: the KV of finished requests, reused by requests that extend them.

A coding agent resends its whole history each step, so consecutive requests of a session share
a prefix of tens of thousands of tokens. When a request leaves its KV slot (finished, aborted or
retracted), the KV of every token it holds (prompt and output, ``all_ids[:kv_len]``) is copied
out of the slot into an entry here; when a request is admitted, the entry sharing the longest
token prefix with it (``min_tokens`` at least) is copied into its slot and only the rest of the
prompt is prefilled. What SGLang's radix cache does, simplified: whole entries, no tree.

* Bounded by bytes: entries are evicted least recently used first; an entry that alone exceeds
  the bound is not kept. An entry that a new one extends is dropped (the new one holds it).
* Lookup is cheap: entries are bucketed by their first ``min_tokens`` tokens (a longest common
  prefix of ``min_tokens`` or more shares them), and the few in the bucket are compared as
  tensors.
* Never across weights: entries carry the weights' epoch (the scheduler bumps it at every weight
  load) and the scheduler clears the cache when weights change; a request whose KV spans two
  epochs (an in-place update while it ran) is not kept.
* Never across adapters: entries carry the LoRA adapter that computed them (its ``uid``, unique
  per load; 0 for the base model), and only a request of the same adapter reuses them: a LoRA
  delta on k and v (or on any earlier layer) makes the same tokens' KV another.

A position's key and value depend only on the tokens up to it (causal attention, RoPE by absolute
position) and the slot cache keeps every position (sliding windows are applied by the mask), so
reuse is exact for every architecture the engine runs, up to float rounding of the different
batch and chunk shapes that computed it (tests/unit/test_engine_prefix_cache.py bounds it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from server.engine.kv_cache import SlotKVCache


@dataclass
class Entry:
    tokens: torch.Tensor  # int64 [n], on the CPU
    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim], on the engine's device
    values: list[torch.Tensor]
    epoch: int
    nbytes: int
    head: tuple[int, ...]  # the first ``min_tokens`` tokens: its bucket
    adapter: int = 0  # the uid of the LoRA adapter that computed it; 0: the base model


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    looked_up_tokens: int = 0
    inserted: int = 0
    evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


@dataclass
class PrefixCache:
    max_bytes: int
    min_tokens: int = 64
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._buckets: dict[tuple[int, ...], set[int]] = {}
        self._next_id = 0
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    # ----- the token-level index --------------------------------------------------------------

    def lookup(
        self, tokens: list[int], epoch: int, limit: int | None = None, adapter: int = 0
    ) -> tuple[Entry, int] | None:
        """``find``, counted as a hit (and the tokens reused) or a miss (when enabled)."""
        if not self.enabled:
            return None
        found = self.find(tokens, epoch, limit, adapter)
        self.stats.looked_up_tokens += len(tokens)
        if found is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.reused_tokens += found[1]
        return found

    def find(
        self, tokens: list[int], epoch: int, limit: int | None = None, adapter: int = 0
    ) -> tuple[Entry, int] | None:
        """The resident entry of ``epoch`` and ``adapter`` sharing the longest prefix with
        ``tokens``, and that length capped at ``limit``; ``None`` when it is under
        ``min_tokens``."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return None
        ids = self._buckets.get(tuple(tokens[: self.min_tokens]))
        if not ids:
            return None
        query = torch.tensor(tokens, dtype=torch.int64)
        best: tuple[int, int] | None = None  # (length, entry id)
        for entry_id in ids:
            entry = self._entries[entry_id]
            if entry.epoch != epoch or entry.adapter != adapter:
                continue
            length = common_prefix(query, entry.tokens)
            if best is None or length > best[0]:
                best = (length, entry_id)
        if best is None:
            return None
        length = best[0] if limit is None else min(best[0], limit)
        if length < self.min_tokens:
            return None
        self._entries.move_to_end(best[1])
        return self._entries[best[1]], length

    def insert(
        self,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        epoch: int,
        adapter: int = 0,
    ) -> bool:
        """Keep ``keys``/``values`` (per layer ``[kv_heads, len(tokens), head_dim]``) for
        ``tokens``; False when it is not kept (too short, or larger than the bound alone)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        ids = torch.tensor(tokens, dtype=torch.int64)
        nbytes = ids.numel() * ids.element_size()
        nbytes += sum(t.numel() * t.element_size() for t in (*keys, *values))
        if nbytes > self.max_bytes:
            return False
        head = tuple(tokens[: self.min_tokens])
        for entry_id in list(self._buckets.get(head, ())):
            entry = self._entries[entry_id]
            if entry.epoch != epoch or entry.adapter != adapter:
                continue
            length = common_prefix(ids, entry.tokens)
            if length == len(ids):  # an entry holds all of it already
                self._entries.move_to_end(entry_id)
                return False
            if length == len(entry.tokens):  # the new entry extends it
                self._remove(entry_id)
        entry = Entry(ids, keys, values, epoch, nbytes, head, adapter)
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evicted += 1
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = entry
        self._buckets.setdefault(head, set()).add(entry_id)
        self.nbytes += nbytes
        self.stats.inserted += 1
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._buckets.clear()
        self.nbytes = 0

    def entries(self) -> list[Entry]:
        """Resident entries, least recently used first."""
        return list(self._entries.values())

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        bucket = self._buckets[entry.head]
        bucket.discard(entry_id)
        if not bucket:
            del self._buckets[entry.head]
        self.nbytes -= entry.nbytes

    # ----- moving KV between a slot and the cache ------------------------------------------------

    @torch.inference_mode()
    def save(
        self, cache: SlotKVCache, slot: int, tokens: list[int], epoch: int, adapter: int = 0
    ) -> bool:
        """Keep the KV ``slot`` holds for ``tokens`` (its first ``len(tokens)`` positions),
        computed with the weights of ``epoch`` and the LoRA adapter ``adapter`` (a uid)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        n = len(tokens)
        keys = [layer[slot, :, :n].clone() for layer in cache.keys]
        values = [layer[slot, :, :n].clone() for layer in cache.values]
        return self.insert(tokens, keys, values, epoch, adapter)

    @torch.inference_mode()
    def restore(self, cache: SlotKVCache, slot: int, entry: Entry, length: int) -> None:
        """Copy the entry's first ``length`` positions into ``slot``'s first positions."""
        cache.reserve(length, slot + 1)
        for layer, (keys, values) in enumerate(zip(entry.keys, entry.values, strict=True)):
            cache.keys[layer][slot, :, :length] = keys[:, :length]
            cache.values[layer][slot, :, :length] = values[:, :length]
