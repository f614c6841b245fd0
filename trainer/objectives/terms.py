"""What every objective ends with: its per-token policy term aggregated into the micro-batch's
share of the minibatch loss, the cross-cutting regularisers (KL to the reference, entropy
bonus), and the statistics.

Aggregations (``algorithm.aggregation``) of per-token values v over a token set K, with
n_i the loss tokens of row i, T = ``total_tokens`` and S = ``total_sequences`` (both over the
whole minibatch, all workers, so micro-batch shares sum to the minibatch's loss):

    token_mean     sum_K v / T                        (DAPO's token-level mean; proxrl's default)
    sequence_mean  sum_K v / n_i / S                  (GRPO, arXiv 2402.03300, eq. 3)
    constant       sum_K v / (C S), C = aggregation_constant   (Dr. GRPO, arXiv 2503.20783)

A row's n_i counts its loss tokens before any masking, as T does: a token a mask removes
contributes zero but still counts, so masking never re-weights the tokens that stay.

The KL term, kl_coef * aggregate(k(log pi/ref)) over the tokens the objective kept, uses
``algorithm.kl_estimator`` (trainer/objectives/kl.py says which KL each one's gradient is); the
entropy bonus, -entropy_coef * aggregate(entropy) over the loss tokens (entropy is exact over
the vocabulary, not an estimate from the sampled token, so no behaviour mask applies to it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.config import AlgorithmConfig
from trainer.objectives.inputs import STAT_NAMES, LossInputs
from trainer.objectives.kl import k3_kl, kl_estimate
from trainer.objectives.ratios import Prepared, masked_sum, row_count


def _sequences(inputs: LossInputs) -> float:
    if inputs.total_sequences <= 0:
        raise ValueError(
            f"total_sequences must be positive for this aggregation, got {inputs.total_sequences}"
        )
    return inputs.total_sequences


def _token_mean(values: Tensor, mask: Tensor, inputs: LossInputs, _: AlgorithmConfig) -> Tensor:
    return masked_sum(values, mask) / inputs.total_tokens


def _sequence_mean(values: Tensor, mask: Tensor, inputs: LossInputs, _: AlgorithmConfig) -> Tensor:
    row_tokens = row_count(inputs.loss_mask.bool(), inputs.sequence_ids).to(values.dtype)
    return masked_sum(values / row_tokens.clamp(min=1), mask) / _sequences(inputs)


def _constant(values: Tensor, mask: Tensor, inputs: LossInputs, algo: AlgorithmConfig) -> Tensor:
    assert algo.aggregation_constant is not None  # check_algorithm requires it
    return masked_sum(values, mask) / (algo.aggregation_constant * _sequences(inputs))


Aggregation = Callable[[Tensor, Tensor, LossInputs, AlgorithmConfig], Tensor]
AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
    "constant": _constant,
}


def aggregate(
    values: Tensor, mask: Tensor, inputs: LossInputs, algorithm: AlgorithmConfig
) -> Tensor:
    """This micro-batch's share of the minibatch aggregate of ``values`` over ``mask``."""
    return AGGREGATIONS[algorithm.aggregation](values, mask, inputs, algorithm)


def finish(
    inputs: LossInputs,
    algorithm: AlgorithmConfig,
    prepared: Prepared,
    policy_term: Tensor,
    kept: Tensor,
    ratio: Tensor,
    **stats: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss from an objective's per-token ``policy_term`` over its ``kept`` tokens, plus
    the regularisers; every statistic of `STAT_NAMES` (``stats`` gives the objective's own,
    the rest are the shared ones or 0)."""
    mask = prepared.loss_mask
    loss = aggregate(policy_term, kept, inputs, algorithm)
    reference_kl = torch.zeros_like(policy_term)
    if inputs.reference is not None:
        reference = inputs.reference.detach()
        reference_kl = kl_estimate(algorithm.kl_estimator, inputs.logprobs, reference, mask)
    if algorithm.kl_coef > 0:
        loss = loss + algorithm.kl_coef * aggregate(reference_kl, kept, inputs, algorithm)
    entropy = torch.zeros_like(policy_term) if inputs.entropy is None else inputs.entropy
    if algorithm.entropy_coef > 0:
        loss = loss - algorithm.entropy_coef * aggregate(entropy, mask, inputs, algorithm)
    with torch.no_grad():
        behaviour = prepared.behaviour
        shared = {
            "tokens": mask.sum(),
            "kept_tokens": kept.sum(),
            "behaviour_over_cap_tokens": behaviour.over_cap.sum(),
            "behaviour_masked_tokens": (mask & ~behaviour.kept).sum(),
            "behaviour_weight_sum": masked_sum(behaviour.raw_weight, mask),
            "ratio_sum": masked_sum(ratio, kept),
            "approx_kl_sum": masked_sum(k3_kl(inputs.logprobs, prepared.proximal, mask), kept),
            "reference_kl_sum": masked_sum(reference_kl, kept),
            "entropy_sum": masked_sum(entropy, mask),
            "pg_loss_sum": masked_sum(policy_term, kept),
        }
        zero = torch.zeros((), dtype=policy_term.dtype, device=policy_term.device)
        out = {name: zero for name in STAT_NAMES} | shared | stats
    return loss, {name: value.detach() for name, value in out.items()}
