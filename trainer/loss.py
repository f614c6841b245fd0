"""Decoupled PPO as it was called before the objectives table: a thin wrapper over
`trainer.objectives.policy_loss`, kept for callers that have not moved to `LossInputs`.

The objectives live in trainer/objectives/ (one module each); this module adds nothing to
them and will go once no caller imports it.
"""

from __future__ import annotations

import torch

from trainer.config import AlgorithmConfig
from trainer.objectives import STAT_NAMES, LossInputs, policy_loss
from trainer.objectives.kl import k3_kl
from trainer.objectives.ratios import MAX_LOG_RATIO

__all__ = ["MAX_LOG_RATIO", "STAT_NAMES", "decoupled_ppo_loss", "k3_kl"]


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
    """`policy_loss` with the old arguments: no entropy, and the micro-batch's own rows as
    ``total_sequences`` (right only for token_mean, the one aggregation old callers used).
    Without ``sequence_ids`` every token is a row of its own."""
    if algorithm.behaviour_mode == "sequence_mask" and sequence_ids is None:
        raise ValueError("behaviour_mode='sequence_mask' needs sequence_ids")
    if sequence_ids is None:
        sequence_ids = torch.arange(logprobs.shape[-1], device=logprobs.device)
    mask = loss_mask.bool()
    rows = torch.unique(sequence_ids[mask]).numel() if mask.shape == sequence_ids.shape else 0
    inputs = LossInputs(
        logprobs=logprobs,
        proximal=proximal_logprobs,
        behaviour=behaviour_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        sequence_ids=sequence_ids,
        entropy=None,
        reference=reference_logprobs,
        total_tokens=total_tokens,
        total_sequences=float(rows),
    )
    return policy_loss(inputs, algorithm)
