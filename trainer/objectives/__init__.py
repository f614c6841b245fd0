"""Policy objectives, one table: ``algorithm.objective`` names an entry of `OBJECTIVES`, one
module each; `policy_loss` is the one call the trainer makes.

    ppo   decoupled PPO, token ratio and clip (AReaL, arXiv 2505.24298)    ppo.py
    gspo  sequence-level ratio and clip (GSPO, arXiv 2507.18071)           gspo.py
    sapo  soft sigmoid gate instead of the clip (SAPO, arXiv 2511.20347)   sapo.py
    m2po  second-moment masking of stale tokens, no clip (M2PO, 2510.01161) m2po.py

Cross-cutting options apply to every entry (trainer/objectives/terms.py): the aggregation of
per-token terms (token_mean, sequence_mean, constant), the KL to the reference with its
estimator (trainer/objectives/kl.py), and the entropy bonus. An objective's value is this
micro-batch's *share* of the minibatch loss: every normaliser is a global total of
`LossInputs`, so the caller sums micro-batches (and workers) to get the minibatch's loss.
Its statistics are the detached sums of `STAT_NAMES` (0 where one does not apply), for the
caller to all-reduce and divide. This package knows nothing about models, packing or
distributed reduction; the options' bounds were checked when the AlgorithmConfig was made.
"""

from __future__ import annotations

from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.gspo import gspo
from trainer.objectives.inputs import STAT_NAMES, LossInputs, Objective, check_inputs
from trainer.objectives.m2po import m2po
from trainer.objectives.ppo import ppo
from trainer.objectives.sapo import sapo

__all__ = ["OBJECTIVES", "STAT_NAMES", "LossInputs", "Objective", "policy_loss"]

OBJECTIVES: dict[str, Objective] = {"ppo": ppo, "gspo": gspo, "sapo": sapo, "m2po": m2po}


def policy_loss(inputs: LossInputs, algorithm: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the minibatch loss under ``algorithm.objective``, and its
    statistics (`STAT_NAMES`). A ValueError names any input that does not fit."""
    check_inputs(inputs, algorithm)
    return OBJECTIVES[algorithm.objective](inputs, algorithm)
