"""GSPO (Zheng et al. 2025, arXiv 2507.18071), the "gspo" objective: a sequence-level
importance ratio, clipped per sequence.

The paper's ratio of row i (§4.1) is the geometric mean of its tokens' ratios,

    s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) = exp( mean_t log(pi(y_i,t) / pi_old(y_i,t)) ),

and its objective min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), averaged over rows. This
module uses the paper's GSPO-token form (§4.3), s_i,t = sg[s_i] pi(y_i,t) / sg[pi(y_i,t)]: its
value is s_i for every token of the row and its gradient s_i grad log pi(y_i,t), so per-token
advantages are allowed, and with one advantage per row it is GSPO exactly (its gradient
matches the sequence form's when aggregated by ``aggregation: sequence_mean``, the paper's
1/G sum_i 1/|y_i| sum_t; the example config sets it).

Decoupled: s_i is centred on the proximal policy (pi_old = pi_prox), and the behaviour weight
w_t = pi_prox / pi_behav stays *per token*, capped or masked as under "ppo": the exact
sequence-level correction would be the product of the row's weights, whose variance grows
exponentially with its length (GSPO's own argument against token products in one ratio), and a
per-token weight keeps ``behaviour_cap`` / ``behaviour_mode`` meaning what they mean for ppo.
The mean in s_i runs over the row's *kept* tokens: a token the behaviour mask removed takes no
part in the loss, and none in its row's ratio either. ``dual_clip`` applies to s_i,t as to r.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import LossInputs
from trainer.objectives.ratios import clipped_policy_loss, log_ratio, prepare, row_count, row_sum
from trainer.objectives.terms import finish


def gspo(inputs: LossInputs, algorithm: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    prepared = prepare(inputs, algorithm)
    kept, ids = prepared.behaviour.kept, inputs.sequence_ids
    token_log_ratio = log_ratio(kept, inputs.logprobs - prepared.proximal)
    kept_in_row = row_count(kept, ids).to(token_log_ratio.dtype).clamp(min=1)
    sequence_log_ratio = row_sum(token_log_ratio, kept, ids) / kept_in_row
    # GSPO-token: the value of s_i, the gradient s_i grad log pi of this token
    ratio = torch.exp(sequence_log_ratio.detach() + token_log_ratio - token_log_ratio.detach())
    eps_high = algorithm.eps_clip if algorithm.eps_clip_high is None else algorithm.eps_clip_high
    pg, clip_active, dual_active = clipped_policy_loss(
        ratio, prepared.advantages, algorithm.eps_clip, eps_high, algorithm.dual_clip
    )
    clipped = clip_active & kept
    return finish(
        inputs,
        algorithm,
        prepared,
        prepared.behaviour.weight * pg,
        kept,
        ratio,
        clipped_tokens=clipped.sum(),
        dual_clipped_tokens=(dual_active & kept).sum(),
        clipped_sequences=torch.unique(ids[clipped]).numel() * torch.ones((), dtype=pg.dtype),
    )
