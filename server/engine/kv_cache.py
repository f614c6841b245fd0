"""A slot-based KV cache that lets many requests of different lengths decode in one forward pass.

Each running request owns one *slot*: a row of a preallocated key/value buffer per layer, shaped
``[slots, kv_heads, capacity, head_dim]``. Running requests always occupy slots ``0..B-1`` (the
scheduler moves the last one into a hole when a request leaves), so a decode step for all of them
reads the buffer views ``[:B, :, :L]`` without copying, and a 4-D attention mask hides each row's
positions past its own length. The buffer is allocated for the slots and positions in use: both
grow by doubling (slots up to ``max_slots``, positions up to the context length) and shrink back
(``fit``) once what runs needs a quarter or less, so one long prompt costs its own KV, not
``max_slots x context``, and not after it finished.

It plugs into any Hugging Face decoder through the ``Cache`` interface: the attention layers call
``update`` with the new keys and values and attend over what it returns. Before each forward the
runner says where the new tokens go (``plan_prefill`` / ``plan_decode``). This module knows
nothing about requests or sampling.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        max_capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 256,
        initial_slots: int = 4,
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.max_slots = max_slots
        self.max_capacity = max_capacity
        self.initial_capacity = min(initial_capacity, max_capacity)
        self.initial_slots = min(initial_slots, max_slots)
        self.capacity = self.initial_capacity
        self.slots = self.initial_slots
        shape = (self.slots, num_kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._rows = slice(0, 0)
        self._write_positions: torch.Tensor | slice = slice(0, 0)
        self._kv_len = 0

    # ----- planning one forward pass -------------------------------------------------------

    def plan_prefill(self, slot: int, start: int, length: int) -> None:
        """The next forward writes ``length`` tokens of ``slot`` at positions ``start...``."""
        self.reserve(start + length, slot + 1)
        self._rows = slice(slot, slot + 1)
        self._write_positions = slice(start, start + length)
        self._kv_len = start + length

    def plan_decode(self, num_rows: int, positions: torch.Tensor) -> None:
        """The next forward writes one token for each slot ``0..num_rows-1`` at ``positions``."""
        kv_len = int(positions.max()) + 1
        self.reserve(kv_len, num_rows)
        self._rows = slice(0, num_rows)
        self._write_positions = positions
        self._kv_len = kv_len

    # ----- the Cache interface the attention layers call ---------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if isinstance(self._write_positions, slice):
            keys[self._rows, :, self._write_positions] = key_states
            values[self._rows, :, self._write_positions] = value_states
        else:
            rows = torch.arange(self._rows.start, self._rows.stop, device=keys.device)
            keys[rows, :, self._write_positions] = key_states[:, :, 0]
            values[rows, :, self._write_positions] = value_states[:, :, 0]
        return keys[self._rows, :, : self._kv_len], values[self._rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def __len__(self) -> int:
        return self.num_layers

    # ----- slot management ----------------------------------------------------------------

    # Buffers grow and move inside inference mode, like every forward that writes them: a tensor
    # made in inference mode cannot be updated outside it.
    @torch.inference_mode()
    def reserve(self, length: int, slots: int = 1) -> None:
        """Make room for ``length`` positions in each of ``slots`` slots (doubling, up to
        ``max_capacity`` positions and ``max_slots`` slots)."""
        if length > self.max_capacity:
            raise ValueError(f"{length} positions exceed the KV capacity {self.max_capacity}")
        if slots > self.max_slots:
            raise ValueError(f"slot {slots - 1} is past the {self.max_slots} KV slots")
        if length <= self.capacity and slots <= self.slots:
            return
        capacity = self.capacity
        if length > capacity:
            capacity = min(max(length, 2 * capacity), self.max_capacity)
        rows = (
            self.slots if slots <= self.slots else min(max(slots, 2 * self.slots), self.max_slots)
        )
        self._reallocate(rows, capacity)

    @torch.inference_mode()
    def fit(self, slots: int, length: int) -> None:
        """Shrink the buffers when the ``slots`` slots in use, ``length`` positions long at
        most, need a quarter of them or less (what they hold is kept)."""
        rows = max(slots, self.initial_slots)
        capacity = max(length, self.initial_capacity)
        if 4 * rows <= self.slots or 4 * capacity <= self.capacity:
            self._reallocate(min(rows, self.slots), min(capacity, self.capacity))

    def _reallocate(self, slots: int, capacity: int) -> None:
        for layer in range(self.num_layers):
            self.keys[layer] = self._resized(self.keys[layer], slots, capacity)
            self.values[layer] = self._resized(self.values[layer], slots, capacity)
        self.slots, self.capacity = slots, capacity

    @staticmethod
    def _resized(buffer: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
        old_slots, heads, old, dim = buffer.shape
        resized = buffer.new_zeros((slots, heads, capacity, dim))
        keep_slots, keep = min(slots, old_slots), min(capacity, old)
        resized[:keep_slots, :, :keep] = buffer[:keep_slots, :, :keep]
        return resized

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for layer in range(self.num_layers):
            self.keys[layer][dst, :, :length] = self.keys[layer][src, :, :length]
            self.values[layer][dst, :, :length] = self.values[layer][src, :, :length]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
