"""M2PO (Zheng et al. 2025, arXiv 2510.01161), the "m2po" objective: second-moment masking of
stale tokens, then the policy gradient without clipping.

Per loss token, M2 = (log pi / pi_behav)^2, with pi the current policy (detached) and pi_behav
the one that sampled it. The tokens with the largest M2 are masked, one by one, until the mean
M2 of the tokens left is below ``m2po_tau`` (the paper's tau_M2, 0.04). The objective is then
(paper, §3) sum_t M_t (pi / pi_old) A_t / sum_i |o_i|: here per token

    term = -M w r A,   r = pi / pi_prox,  w = pi_prox / pi_behav   (so w r = pi / pi_behav)

aggregated as ``aggregation`` says (token_mean is the paper's 1 / sum |o_i|; masked tokens
still count in it). Under plain PPO pi_prox = pi_behav and w = 1. ``behaviour_cap`` still
applies to w; the example config turns it off, as the mask already bounds what is stale.

The mask is chosen per micro-batch (a pure function cannot sort the whole minibatch across
workers). Every micro-batch's kept tokens have mean M2 below tau, so the whole minibatch's
kept tokens have too (a mean of means below tau): the bound the paper asks for holds; a
micro-batch may mask a few more tokens than the minimum over the whole minibatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import LossInputs
from trainer.objectives.ratios import log_ratio, prepare
from trainer.objectives.terms import finish


def second_moment_mask(second_moment: Tensor, mask: Tensor, tau: float) -> Tensor:
    """Which ``mask`` tokens to drop: the fewest of largest ``second_moment`` such that the mean
    of the rest is below ``tau`` (every one, if none is)."""
    values = second_moment[mask]
    order = torch.argsort(values, descending=True, stable=True)
    ordered = values[order]
    count = ordered.numel()
    suffix_sums = torch.flip(torch.cumsum(torch.flip(ordered, (0,)), 0), (0,))
    suffix_means = suffix_sums / torch.arange(count, 0, -1, device=values.device)
    below = torch.nonzero(suffix_means < tau)
    dropped = int(below[0]) if below.numel() else count
    drop_sorted = torch.arange(count, device=values.device) < dropped
    drop = torch.zeros_like(values, dtype=torch.bool)
    drop[order] = drop_sorted
    out = torch.zeros_like(mask)
    out[mask] = drop
    return out


def m2po(inputs: LossInputs, algorithm: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    prepared = prepare(inputs, algorithm)
    mask, behaviour_kept = prepared.loss_mask, prepared.behaviour.kept
    staleness = log_ratio(behaviour_kept, inputs.logprobs.detach() - inputs.behaviour.detach())
    masked = second_moment_mask(staleness**2, behaviour_kept, algorithm.m2po_tau)
    kept = behaviour_kept & ~masked
    ratio = torch.exp(log_ratio(mask, inputs.logprobs - prepared.proximal))
    term = -prepared.behaviour.weight * ratio * prepared.advantages
    return finish(
        inputs,
        algorithm,
        prepared,
        term,
        kept,
        ratio,
        second_moment_masked_tokens=masked.sum(),
    )
