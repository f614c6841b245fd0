"""SAPO (Gao et al. 2025, arXiv 2511.20347), the "sapo" objective: a soft, temperature-
controlled gate in place of PPO's hard clip. Per token, with r = pi / pi_prox and advantage A,

    f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = sapo_tau_pos if A > 0 else sapo_tau_neg
    term = -w f(r) A                         (w = pi_prox / pi_behav, as under "ppo")

The gate's slope at r = 1 is 1 (sigmoid'(0) = 1/4), so on-policy tokens get the plain policy
gradient; away from r = 1 their gradient fades smoothly, the faster the larger tau (the paper
takes tau_neg > tau_pos: negative advantages raise many unsampled tokens' logits and are damped
harder). The paper averages per sequence (1/G sum_i 1/|y_i| sum_t); set ``aggregation:
sequence_mean`` for that (the example config does). No token is clipped: ``clipped_tokens`` is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import LossInputs
from trainer.objectives.ratios import log_ratio, prepare
from trainer.objectives.terms import finish


def sapo(inputs: LossInputs, algorithm: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    prepared = prepare(inputs, algorithm)
    advantages = prepared.advantages
    ratio = torch.exp(log_ratio(prepared.loss_mask, inputs.logprobs - prepared.proximal))
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, algorithm.sapo_tau_pos),
        torch.full_like(ratio, algorithm.sapo_tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    term = -prepared.behaviour.weight * gate * advantages
    return finish(inputs, algorithm, prepared, term, prepared.behaviour.kept, ratio)
