"""Decoupled PPO (AReaL, arXiv 2505.24298, §5), the "ppo" objective. Per token, with
ratio r = pi / pi_prox and advantage A:

    pg   = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))   (dual clip: for A < 0, at
                                                                     most -A c)
    w    = pi_prox / pi_behav, detached; capped, or its tokens masked, above ``behaviour_cap``
    term = w pg, aggregated over the kept tokens (trainer/objectives/terms.py)

Plain PPO (``algorithm.decoupled`` false) is the special case pi_prox = pi_behav: w = 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import LossInputs
from trainer.objectives.ratios import clipped_policy_loss, log_ratio, prepare
from trainer.objectives.terms import finish


def ppo(inputs: LossInputs, algorithm: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    prepared = prepare(inputs, algorithm)
    mask, kept = prepared.loss_mask, prepared.behaviour.kept
    ratio = torch.exp(log_ratio(mask, inputs.logprobs - prepared.proximal))
    eps_high = algorithm.eps_clip if algorithm.eps_clip_high is None else algorithm.eps_clip_high
    pg, clip_active, dual_active = clipped_policy_loss(
        ratio, prepared.advantages, algorithm.eps_clip, eps_high, algorithm.dual_clip
    )
    return finish(
        inputs,
        algorithm,
        prepared,
        prepared.behaviour.weight * pg,
        kept,
        ratio,
        clipped_tokens=(clip_active & kept).sum(),
        dual_clipped_tokens=(dual_active & kept).sum(),
    )
