"""Decoupled PPO loss (AReaL, arXiv 2505.24298) on packed tokens.

Three log-probabilities of the same sampled token take part, each a 1-D tensor over the packed
tokens of one micro-batch:

- ``logprobs``: the policy being optimised, under the current weights (carries the gradient);
- ``proximal_logprobs``: recomputed with the weights at the start of this training step, before
  any minibatch update (no gradient). The PPO trust region is centred here;
- ``behaviour_logprobs``: what the inference engine sampled with, possibly several versions
  old (no gradient). It only enters through the importance weight pi_prox / pi_behav.

Per token, with ratio r = pi / pi_prox and advantage A:

    pg   = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))   (dual clip: for A < 0, at
                                                                     most -A c)
    w    = pi_prox / pi_behav, detached; capped, or its tokens masked, above ``behaviour_cap``
    loss = w pg + kl_coef k3(pi_ref, pi)

summed over the loss tokens and divided by ``total_tokens``, the number of loss tokens in the
whole step (all micro-batches, all workers). Summing the returned losses over micro-batches
(and the gradients over workers) therefore gives the token mean of the step. Tokens removed by
the behaviour mask still count in ``total_tokens``, as in AReaL: they contribute zero.

Plain PPO (``algorithm.decoupled`` false) is the special case ``proximal_logprobs =
behaviour_logprobs``: then w = 1 exactly and no token exceeds a cap >= 1.

Masked tokens take no part, not even as NaN: every log-ratio is zeroed outside the loss mask
before it is exponentiated, so a masked token with an absurd logprob (a prompt position, a
stale or off-temperature token) can put neither inf nor NaN into the loss or its gradient; a
token the behaviour mask removes gets weight 0, not an infinite weight times 0; and log-ratios
are clamped to +-``MAX_LOG_RATIO`` before exp (a ratio of e^80 never occurs in a healthy run,
but one absurd logprob must not make the loss infinite).

The options come whole from the frozen `AlgorithmConfig`, whose bounds (clip ranges, cap, dual
clip) are checked once, when it is made; this module does not check them again. It knows
nothing about models, packing or distributed reduction: it is a pure function of tensors, and
its statistics are sums the caller all-reduces and divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.config import AlgorithmConfig

MAX_LOG_RATIO = 80.0  # exp(80) ~ 5.5e34: finite in float32, and far beyond any cap

BehaviourMode = Literal["truncate", "token_mask", "sequence_mask"]
BEHAVIOUR_MODES: tuple[BehaviourMode, ...] = ("truncate", "token_mask", "sequence_mask")

STAT_NAMES = (
    "tokens",  # loss tokens (loss_mask), before behaviour masking
    "kept_tokens",  # loss tokens left after behaviour masking
    "behaviour_over_cap_tokens",  # loss tokens whose behaviour weight exceeds the cap
    "behaviour_masked_tokens",  # loss tokens removed by behaviour masking (tokens - kept)
    "behaviour_weight_sum",  # raw pi_prox / pi_behav, over loss tokens
    "clipped_tokens",  # kept tokens where the PPO clip is active (clipped term is larger)
    "dual_clipped_tokens",  # kept tokens with A < 0 where the dual clip bound is active
    "ratio_sum",  # pi / pi_prox, over kept tokens
    "approx_kl_sum",  # k3 estimate of KL(pi || pi_prox), over kept tokens
    "reference_kl_sum",  # k3 estimate of KL(pi || pi_ref), over kept tokens (0 without a ref)
    "pg_loss_sum",  # w * pg (the loss without the KL term), over kept tokens
)


def k3_kl(
    logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token k3 estimator exp(q - p) - (q - p) - 1 >= 0, with p = logprobs, q = other;
    0 outside ``mask`` (where the log-ratio is never exponentiated)."""
    log_ratio = _log_ratio(mask, other_logprobs - logprobs)
    return torch.exp(log_ratio) - log_ratio - 1


def _log_ratio(mask: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask``, else 0, within +-MAX_LOG_RATIO: applied to log-ratios *before*
    exp, so that no token overflows in the forward pass or sends 0 * inf = NaN back in the
    backward."""
    if mask is not None:
        values = torch.where(mask, values, torch.zeros_like(values))
    return torch.clamp(values, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def _check_inputs(
    logprobs: torch.Tensor, others: dict[str, torch.Tensor | None], total_tokens: float
) -> None:
    shape = logprobs.shape
    if len(shape) != 1:
        raise ValueError(f"logprobs must be 1-D over packed tokens, got shape {tuple(shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be positive, got {total_tokens}")


def clipped_policy_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO policy loss, with where the clip and the dual clip are active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    bound = -advantages * dual_clip
    dual_active = (advantages < 0) & (loss > bound)
    return torch.where(dual_active, bound, loss), clip_active, dual_active


def _sequence_any(flags: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """For each token, whether any token of its sequence has its flag set."""
    if flags.numel() == 0:
        return flags
    per_sequence = torch.zeros(int(sequence_ids.max()) + 1, dtype=torch.long, device=flags.device)
    per_sequence.index_add_(0, sequence_ids, flags.long())
    return per_sequence[sequence_ids] > 0


@dataclass(frozen=True)
class BehaviourCorrection:
    """Per token: the weight that multiplies the policy loss, and which loss tokens stay."""

    weight: torch.Tensor
    kept: torch.Tensor
    raw_weight: torch.Tensor  # pi_prox / pi_behav before any cap
    over_cap: torch.Tensor  # loss tokens whose raw weight exceeds the cap


def behaviour_correction(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float | None,
    mode: BehaviourMode,
    sequence_ids: torch.Tensor | None,
) -> BehaviourCorrection:
    """The importance weight pi_prox / pi_behav (detached), capped or masked above ``cap``;
    1 outside the loss mask, and 0 on the tokens it removes."""
    raw = torch.exp(_log_ratio(loss_mask, proximal_logprobs - behaviour_logprobs)).detach()
    if cap is None:
        return BehaviourCorrection(raw, loss_mask, raw, torch.zeros_like(loss_mask))
    over_cap = (raw > cap) & loss_mask
    if mode == "truncate":
        return BehaviourCorrection(torch.clamp(raw, max=cap), loss_mask, raw, over_cap)
    if mode == "token_mask":
        kept = loss_mask & ~over_cap
    elif sequence_ids is None:
        raise ValueError("behaviour_mode='sequence_mask' needs sequence_ids")
    else:
        kept = loss_mask & ~_sequence_any(over_cap, sequence_ids)
    weight = torch.where(kept | ~loss_mask, raw, torch.zeros_like(raw))
    return BehaviourCorrection(weight, kept, raw, over_cap)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    total_tokens: float,
    algorithm: AlgorithmConfig,
    sequence_ids: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO loss of one micro-batch and its detached statistics (see module docstring).

    ``loss_mask`` is 1 (or True) on tokens the policy produced. ``proximal_logprobs`` may be
    None only for plain PPO. From ``algorithm``: ``eps_clip`` / ``eps_clip_high`` and
    ``dual_clip`` shape the clip; ``behaviour_cap`` None leaves the behaviour weight as it is,
    otherwise ``behaviour_mode`` says what happens above it: ``truncate`` caps the weight,
    ``token_mask`` drops the token, ``sequence_mask`` drops every token of its sequence
    (``sequence_ids`` gives each token's sequence); ``kl_coef`` weighs the k3 KL to
    ``reference_logprobs``. The statistics are the sums named in `STAT_NAMES`, for the caller
    to all-reduce and divide.
    """
    if not algorithm.decoupled or proximal_logprobs is None:
        if algorithm.decoupled:
            raise ValueError("decoupled PPO needs proximal_logprobs")
        proximal_logprobs = behaviour_logprobs  # plain PPO: w = 1 exactly
    _check_inputs(
        logprobs,
        {
            "proximal_logprobs": proximal_logprobs,
            "behaviour_logprobs": behaviour_logprobs,
            "advantages": advantages,
            "loss_mask": loss_mask,
            "sequence_ids": sequence_ids,
            "reference_logprobs": reference_logprobs,
        },
        total_tokens,
    )
    proximal_logprobs = proximal_logprobs.detach()
    advantages = advantages.detach()
    loss_mask = loss_mask.bool()

    ratio = torch.exp(_log_ratio(loss_mask, logprobs - proximal_logprobs))
    eps_high = algorithm.eps_clip if algorithm.eps_clip_high is None else algorithm.eps_clip_high
    pg, clip_active, dual_active = clipped_policy_loss(
        ratio, advantages, algorithm.eps_clip, eps_high, algorithm.dual_clip
    )
    behaviour = behaviour_correction(
        proximal_logprobs,
        behaviour_logprobs,
        loss_mask,
        algorithm.behaviour_cap if algorithm.decoupled else None,
        algorithm.behaviour_mode,
        sequence_ids,
    )
    kept = behaviour.kept
    pg_loss = behaviour.weight * pg
    reference_kl = torch.zeros_like(pg_loss)
    if reference_logprobs is not None:
        reference_kl = k3_kl(logprobs, reference_logprobs.detach(), loss_mask)
    kl_coef = algorithm.kl_coef
    per_token = pg_loss + kl_coef * reference_kl if kl_coef > 0.0 else pg_loss
    loss = _masked_sum(per_token, kept) / total_tokens

    with torch.no_grad():
        stats = {
            "tokens": loss_mask.sum(),
            "kept_tokens": kept.sum(),
            "behaviour_over_cap_tokens": behaviour.over_cap.sum(),
            "behaviour_masked_tokens": (loss_mask & ~kept).sum(),
            "behaviour_weight_sum": _masked_sum(behaviour.raw_weight, loss_mask),
            "clipped_tokens": (clip_active & kept).sum(),
            "dual_clipped_tokens": (dual_active & kept).sum(),
            "ratio_sum": _masked_sum(ratio, kept),
            "approx_kl_sum": _masked_sum(k3_kl(logprobs, proximal_logprobs, loss_mask), kept),
            "reference_kl_sum": _masked_sum(reference_kl, kept),
            "pg_loss_sum": _masked_sum(pg_loss, kept),
        }
    return loss, {name: value.detach() for name, value in stats.items()}
