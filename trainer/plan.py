"""Which worker trains which rows, in which micro-batch: the shape of one training step.

Rows are split into PPO minibatches, each minibatch balanced across workers by tokens, and each
worker's share packed into token-budget micro-batches. FSDP2 runs collectives in every forward
and backward, so every worker must run the same number of micro-batches per minibatch: the
plan pads short workers with empty micro-batches. Pure: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.batching import balance, minibatches, pack
from trainer.rollouts import Sample
from trainer.worker import MicroBatch


@dataclass
class StepPlan:
    per_rank: list[list[list[MicroBatch]]]  # [rank][minibatch][micro-batch]
    tokens: list[int]  # loss tokens per minibatch, over all workers


def micro_batch(samples: Sequence[Sample]) -> MicroBatch:
    return MicroBatch(
        rows=[s.input_ids for s in samples],
        loss_mask=[s.loss_mask for s in samples],
        behaviour=[s.behaviour for s in samples],
        advantages=[s.advantages for s in samples],
        fresh=[s.fresh or [0] * len(s.input_ids) for s in samples],
    )


def plan_step(
    samples: Sequence[Sample], world_size: int, minibatch_count: int, max_tokens: int
) -> StepPlan:
    per_rank: list[list[list[MicroBatch]]] = [[] for _ in range(world_size)]
    tokens: list[int] = []
    for indices in minibatches(len(samples), minibatch_count):
        chosen = [samples[i] for i in indices]
        tokens.append(sum(s.loss_tokens for s in chosen))
        shares = balance([len(s.input_ids) for s in chosen], world_size)
        packed_shares = []
        for share in shares:
            rows = [chosen[i] for i in share]
            groups = pack([len(r.input_ids) for r in rows], max_tokens) if rows else []
            packed_shares.append([micro_batch([rows[i] for i in group]) for group in groups])
        depth = max(1, max(len(micros) for micros in packed_shares))
        for rank, micros in enumerate(packed_shares):
            per_rank[rank].append(micros + [MicroBatch() for _ in range(depth - len(micros))])
    return StepPlan(per_rank=per_rank, tokens=tokens)
