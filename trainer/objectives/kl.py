"""Per-token estimators of the KL divergence between the policy pi and the frozen reference
(Schulman, "Approximating KL Divergence", 2020), with r = pi_ref(x) / pi(x) at a token x:

    k1 = -log r                 value: unbiased for KL(pi || ref) when x ~ pi
    k2 = (log r)^2 / 2          value: biased (low variance) for KL(pi || ref)
    k3 = (r - 1) - log r        value: unbiased for KL(pi || ref), and >= 0

In the *loss* (the token x held fixed, differentiated through log pi(x)), what matters is the
expected gradient, E_{x~pi}[grad k(x)]:

    k1: E[grad log pi] = 0                                        (regularises nothing)
    k2: E[log(pi/ref) grad log pi] = grad KL(pi || ref)           (reverse KL, mode seeking)
    k3: E[(1 - ref/pi) grad log pi] = -sum_x ref grad log pi = grad KL(ref || pi)  (forward KL)

so the k3 term, proxrl's default, pulls toward the reference by the gradient of KL(ref || pi)
though its value estimates KL(pi || ref). Knows nothing about the loss around it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.objectives.ratios import log_ratio

KlEstimator = Callable[[Tensor], Tensor]  # of log(pi / ref), per token


def k1(log_pi_over_ref: Tensor) -> Tensor:
    return log_pi_over_ref


def k2(log_pi_over_ref: Tensor) -> Tensor:
    return 0.5 * log_pi_over_ref**2


def k3(log_pi_over_ref: Tensor) -> Tensor:
    return torch.exp(-log_pi_over_ref) - 1 + log_pi_over_ref


KL_ESTIMATORS: dict[str, KlEstimator] = {"k1": k1, "k2": k2, "k3": k3}


def kl_estimate(
    estimator: str, logprobs: Tensor, other_logprobs: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Per token, ``estimator`` of KL(pi || other) with log pi = ``logprobs``; 0 outside
    ``mask`` (where the log-ratio is never exponentiated)."""
    return KL_ESTIMATORS[estimator](log_ratio(mask, logprobs - other_logprobs))


def k3_kl(logprobs: Tensor, other_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token k3, exp(q - p) - (q - p) - 1 >= 0 with p = ``logprobs``, q = ``other``: its
    value estimates KL(pi || other) for tokens drawn from pi; as a loss term its gradient is
    that of KL(other || pi) (see the module docstring)."""
    return kl_estimate("k3", logprobs, other_logprobs, mask)
