"""A slot-based KV cache that lets many requests of different lengths decode in one forward pass.

Each running request owns one *slot*: a row of a preallocated key/value buffer per layer, shaped
``[slots, kv_heads, capacity, head_dim]``. Running requests always occupy slots ``0..B-1`` (the
scheduler moves the last one into a hole when a request leaves), so a decode step for all of them
reads the buffer views ``[:B, :, :L]`` without copying, and a 4-D attention mask hides each row's
positions past its own length. The capacity grows by doubling up to the context length.

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
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.max_slots = max_slots
        self.max_capacity = max_capacity
        self.capacity = min(initial_capacity, max_capacity)
        shape = (max_slots, num_kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._rows = slice(0, 0)
        self._write_positions: torch.Tensor | slice = slice(0, 0)
        self._kv_len = 0

    # ----- planning one forward pass -------------------------------------------------------

    def plan_prefill(self, slot: int, start: int, length: int) -> None:
        """The next forward writes ``length`` tokens of ``slot`` at positions ``start...``."""
        self.reserve(start + length)
        self._rows = slice(slot, slot + 1)
        self._write_positions = slice(start, start + length)
        self._kv_len = start + length

    def plan_decode(self, num_rows: int, positions: torch.Tensor) -> None:
        """The next forward writes one token for each slot ``0..num_rows-1`` at ``positions``."""
        kv_len = int(positions.max()) + 1
        self.reserve(kv_len)
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
    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions per slot (doubling, up to ``max_capacity``)."""
        if length <= self.capacity:
            return
        if length > self.max_capacity:
            raise ValueError(f"{length} positions exceed the KV capacity {self.max_capacity}")
        new_capacity = min(max(length, 2 * self.capacity), self.max_capacity)
        for layer in range(self.num_layers):
            self.keys[layer] = self._grown(self.keys[layer], new_capacity)
            self.values[layer] = self._grown(self.values[layer], new_capacity)
        self.capacity = new_capacity

    @staticmethod
    def _grown(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        slots, heads, old, dim = buffer.shape
        grown = buffer.new_zeros((slots, heads, capacity, dim))
        grown[:, :, :old] = buffer
        return grown

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for layer in range(self.num_layers):
            self.keys[layer][dst, :, :length] = self.keys[layer][src, :, :length]
            self.values[layer][dst, :, :length] = self.values[layer][src, :, :length]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
