"""What every objective receives, and what it gives back: the contract of the objectives table.

An objective sees one micro-batch's packed tokens (1-D tensors of equal length) and the step's
global totals; it returns its *share* of the minibatch loss (the caller sums micro-batches and
workers) and detached sums for the figures. It knows nothing about models, packing or
distributed reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from trainer.config import AlgorithmConfig


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's packed tokens. Which log-probability is which:

    - ``logprobs``: the policy being optimised, under the current weights (carries the grad);
    - ``proximal``: recomputed with the weights at the start of the step (no grad); None for
      plain PPO (``algorithm.decoupled`` false), where the behaviour policy stands in for it;
    - ``behaviour``: what the inference engine sampled with, possibly versions old;
    - ``reference``: the frozen reference (initial) model's, when ``kl_coef`` > 0.
    """

    logprobs: Tensor
    proximal: Tensor | None
    behaviour: Tensor
    advantages: Tensor
    loss_mask: Tensor  # bool (or 0/1): the tokens the policy produced and is trained on
    sequence_ids: Tensor  # long: the row of the micro-batch each token is in
    entropy: Tensor | None  # with grad when entropy_coef > 0
    reference: Tensor | None
    total_tokens: float  # loss tokens in this minibatch over all workers
    total_sequences: float  # rows with >= 1 loss token in this minibatch over all workers


Objective = Callable[[LossInputs, AlgorithmConfig], tuple[Tensor, dict[str, Tensor]]]

STAT_NAMES = (
    "tokens",  # loss tokens (loss_mask), before behaviour masking
    "kept_tokens",  # loss tokens left after behaviour (and M2PO) masking
    "behaviour_over_cap_tokens",  # loss tokens whose behaviour weight exceeds the cap
    "behaviour_masked_tokens",  # loss tokens removed by behaviour masking
    "behaviour_weight_sum",  # raw pi_prox / pi_behav, over loss tokens
    "clipped_tokens",  # kept tokens where the clip is active (gspo: their sequence's clip)
    "dual_clipped_tokens",  # kept tokens with A < 0 where the dual clip bound is active
    "clipped_sequences",  # gspo: rows with loss tokens whose sequence ratio is clipped
    "second_moment_masked_tokens",  # m2po: loss tokens masked to bound the second moment
    "ratio_sum",  # pi / pi_prox (gspo: the token's sequence ratio), over kept tokens
    "approx_kl_sum",  # k3 estimate of KL(pi || pi_prox) (its value), over kept tokens
    "reference_kl_sum",  # the kl_estimator's value against the reference, over kept tokens
    "entropy_sum",  # entropy over loss tokens (0 without entropy)
    "pg_loss_sum",  # the policy term per token (before aggregation), over kept tokens
)


def check_inputs(inputs: LossInputs, algorithm: AlgorithmConfig) -> None:
    """Shapes, totals and the tensors the algorithm's options need; a ValueError naming what
    is wrong (the options' own bounds were checked when the algorithm was made)."""
    shape = inputs.logprobs.shape
    if len(shape) != 1:
        raise ValueError(f"logprobs must be 1-D over packed tokens, got shape {tuple(shape)}")
    for name in ("proximal", "behaviour", "advantages", "loss_mask", "sequence_ids"):
        _check_shape(name, getattr(inputs, name), shape)
    for name in ("entropy", "reference"):
        _check_shape(name, getattr(inputs, name), shape)
    if inputs.total_tokens <= 0:
        raise ValueError(f"total_tokens must be positive, got {inputs.total_tokens}")
    if inputs.total_sequences < 0:
        raise ValueError(f"total_sequences must be >= 0, got {inputs.total_sequences}")
    if algorithm.decoupled and inputs.proximal is None:
        raise ValueError("decoupled PPO needs the proximal logprobs")
    if algorithm.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("algorithm.entropy_coef > 0 needs the entropy of every token")
    if algorithm.kl_coef > 0 and inputs.reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs the reference model's logprobs")


def _check_shape(name: str, tensor: Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
