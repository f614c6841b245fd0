"""Token arithmetic every objective shares: safe log-ratios, the behaviour correction, the PPO
clip, and per-row sums over packed tokens.

Masked tokens take no part, not even as NaN: every log-ratio is zeroed outside its mask before
it is exponentiated, so a masked token with an absurd logprob (a prompt position, a stale or
off-temperature token) can put neither inf nor NaN into a loss or its gradient; a token the
behaviour mask removes gets weight 0, not an infinite weight times 0; and log-ratios are clamped
to +-``MAX_LOG_RATIO`` before exp (a ratio of e^80 never occurs in a healthy run, but one absurd
logprob must not make the loss infinite). Knows nothing of any objective's form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import LossInputs

MAX_LOG_RATIO = 80.0  # exp(80) ~ 5.5e34: finite in float32, and far beyond any cap

BehaviourMode = Literal["truncate", "token_mask", "sequence_mask"]


def log_ratio(mask: Tensor | None, values: Tensor) -> Tensor:
    """``values`` where ``mask``, else 0, within +-MAX_LOG_RATIO: applied to log-ratios *before*
    exp, so that no token overflows in the forward pass or sends 0 * inf = NaN back."""
    if mask is not None:
        values = torch.where(mask, values, torch.zeros_like(values))
    return torch.clamp(values, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def row_sum(values: Tensor, mask: Tensor, sequence_ids: Tensor) -> Tensor:
    """Per token, the sum of ``values`` over the ``mask`` tokens of its row (gradient flows)."""
    if values.numel() == 0:
        return values
    rows = int(sequence_ids.max()) + 1
    sums = torch.zeros(rows, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, sequence_ids, torch.where(mask, values, torch.zeros_like(values)))
    return sums[sequence_ids]


def row_count(mask: Tensor, sequence_ids: Tensor) -> Tensor:
    """Per token, how many ``mask`` tokens its row has (float)."""
    return row_sum(mask.double(), mask, sequence_ids)


def first_of_row(sequence_ids: Tensor) -> Tensor:
    """True at the first token of each row (rows are contiguous in a packed batch)."""
    first = torch.ones_like(sequence_ids, dtype=torch.bool)
    first[1:] = sequence_ids[1:] != sequence_ids[:-1]
    return first


def clipped_policy_loss(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO policy loss max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), bounded by
    -A c for A < 0 under a dual clip c; with where the clip and the dual clip are active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    bound = -advantages * dual_clip
    dual_active = (advantages < 0) & (loss > bound)
    return torch.where(dual_active, bound, loss), clip_active, dual_active


@dataclass(frozen=True)
class BehaviourCorrection:
    """Per token: the weight that multiplies the policy loss, and which loss tokens stay."""

    weight: Tensor
    kept: Tensor
    raw_weight: Tensor  # pi_prox / pi_behav before any cap
    over_cap: Tensor  # loss tokens whose raw weight exceeds the cap


def behaviour_correction(
    proximal: Tensor,
    behaviour: Tensor,
    loss_mask: Tensor,
    cap: float | None,
    mode: BehaviourMode,
    sequence_ids: Tensor,
) -> BehaviourCorrection:
    """The importance weight pi_prox / pi_behav (detached), capped or masked above ``cap``;
    1 outside the loss mask, and 0 on the tokens it removes."""
    raw = torch.exp(log_ratio(loss_mask, proximal - behaviour)).detach()
    if cap is None:
        return BehaviourCorrection(raw, loss_mask, raw, torch.zeros_like(loss_mask))
    over_cap = (raw > cap) & loss_mask
    if mode == "truncate":
        return BehaviourCorrection(torch.clamp(raw, max=cap), loss_mask, raw, over_cap)
    if mode == "token_mask":
        kept = loss_mask & ~over_cap
    else:
        kept = loss_mask & ~(row_count(over_cap, sequence_ids) > 0)
    weight = torch.where(kept | ~loss_mask, raw, torch.zeros_like(raw))
    return BehaviourCorrection(weight, kept, raw, over_cap)


@dataclass(frozen=True)
class Prepared:
    """What every objective starts from: the proximal logprobs (the behaviour ones under plain
    PPO) and the advantages, detached; the loss mask as bool; the behaviour correction."""

    proximal: Tensor
    advantages: Tensor
    loss_mask: Tensor
    behaviour: BehaviourCorrection


def prepare(inputs: LossInputs, algorithm: AlgorithmConfig) -> Prepared:
    """Plain PPO (``algorithm.decoupled`` false) is the special case proximal = behaviour:
    then w = 1 exactly, and no cap applies."""
    proximal = inputs.proximal if algorithm.decoupled and inputs.proximal is not None else None
    proximal = (inputs.behaviour if proximal is None else proximal).detach()
    mask = inputs.loss_mask.bool()
    correction = behaviour_correction(
        proximal,
        inputs.behaviour.detach(),
        mask,
        algorithm.behaviour_cap if algorithm.decoupled else None,
        algorithm.behaviour_mode,
        inputs.sequence_ids,
    )
    return Prepared(proximal, inputs.advantages.detach(), mask, correction)
