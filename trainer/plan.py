"""Which worker trains which rows, in which micro-batch: the shape of one training step.

Rows are split into PPO minibatches (`minibatches`), each minibatch balanced across workers by
tokens (`balance`), and each worker's share packed into token-budget micro-batches (`pack`).
FSDP2 runs collectives in every forward and backward, so every worker must run the same number
of micro-batches per minibatch: the plan pads short workers with empty micro-batches. It also
counts, per minibatch over all workers, the loss tokens and the rows holding any: the
denominators of a token mean and of a sequence mean.

Pure: plain lists and integers, no torch, no Ray (a test imports it and checks). Turning a
`MicroBatch` into tensors is ``trainer/batching.py``'s; updating on it, ``trainer/algorithm.py``'s.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.rollouts import Sample


@dataclass
class MicroBatch:
    """Rows packed together on one worker; per-token lists align with ``rows``."""

    rows: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    behaviour: list[list[float]] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    fresh: list[list[int]] = field(default_factory=list)  # loss tokens at staleness 0
    # algorithm.critic: each token's reward (a turn's at its last loss token, 0 elsewhere)
    rewards: list[list[float]] = field(default_factory=list)


@dataclass
class StepPlan:
    per_rank: list[list[list[MicroBatch]]]  # [rank][minibatch][micro-batch]
    tokens: list[int]  # loss tokens per minibatch, over all workers
    sequences: list[int]  # rows with at least one loss token per minibatch, over all workers


def check_lengths(lengths: Sequence[int]) -> None:
    """Refuse a row without tokens, naming it."""
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"row {i} has length {length}; every row needs at least one token")


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, first-fit decreasing, each micro-batch <= ``max_tokens``.

    Rows are taken longest first (ties by index) and go to the first micro-batch they fit in. A
    row longer than ``max_tokens`` gets a micro-batch of its own (the trainer limits rows
    separately, by ``algorithm.max_tokens_per_row``). Micro-batches come in the order they were
    opened; indices within one are ascending.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    check_lengths(lengths)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, room in enumerate(free) if lengths[i] <= room), None)
        if slot is None:
            bins.append([])
            free.append(max(max_tokens, lengths[i]))
            slot = len(bins) - 1
        bins[slot].append(i)
        free[slot] -= lengths[i]
    return [sorted(rows) for rows in bins]


def balance(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices per data-parallel worker, token counts as equal as greedy allows.

    Longest row first (ties by index) to the lightest part (ties by part index): the classic
    LPT rule, within 4/3 of the best possible largest part. A part is empty only when there are
    fewer rows than parts. Indices within a part are ascending.
    """
    if parts < 1:
        raise ValueError(f"parts must be positive, got {parts}")
    check_lengths(lengths)
    loads = [(0, part) for part in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, part = heapq.heappop(loads)
        shares[part].append(i)
        heapq.heappush(loads, (load + lengths[i], part))
    return [sorted(share) for share in shares]


def minibatches(n_rows: int, count: int) -> list[list[int]]:
    """``count`` contiguous runs of row indices, sizes differing by at most one (larger first).

    ``count`` is clipped to ``n_rows`` so no minibatch is empty; no rows give no minibatches.
    """
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    if n_rows < 0:
        raise ValueError(f"n_rows must not be negative, got {n_rows}")
    count = min(count, n_rows)
    out: list[list[int]] = []
    start = 0
    for k in range(count):
        size = n_rows // count + (1 if k < n_rows % count else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def micro_batch(samples: Sequence[Sample]) -> MicroBatch:
    return MicroBatch(
        rows=[s.input_ids for s in samples],
        loss_mask=[s.loss_mask for s in samples],
        behaviour=[s.behaviour for s in samples],
        advantages=[s.advantages for s in samples],
        fresh=[s.fresh or [0] * len(s.input_ids) for s in samples],
        rewards=[s.rewards or [0.0] * len(s.input_ids) for s in samples],
    )


def plan_step(
    samples: Sequence[Sample], world_size: int, minibatch_count: int, max_tokens: int
) -> StepPlan:
    per_rank: list[list[list[MicroBatch]]] = [[] for _ in range(world_size)]
    tokens: list[int] = []
    sequences: list[int] = []
    for indices in minibatches(len(samples), minibatch_count):
        chosen = [samples[i] for i in indices]
        tokens.append(sum(s.loss_tokens for s in chosen))
        sequences.append(sum(1 for s in chosen if s.loss_tokens > 0))
        shares = balance([len(s.input_ids) for s in chosen], world_size)
        packed_shares = []
        for share in shares:
            rows = [chosen[i] for i in share]
            groups = pack([len(r.input_ids) for r in rows], max_tokens) if rows else []
            packed_shares.append([micro_batch([rows[i] for i in group]) for group in groups])
        depth = max(1, max(len(micros) for micros in packed_shares))
        for rank, micros in enumerate(packed_shares):
            per_rank[rank].append(micros + [MicroBatch() for _ in range(depth - len(micros))])
    return StepPlan(per_rank=per_rank, tokens=tokens, sequences=sequences)
