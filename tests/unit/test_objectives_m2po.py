"""M2PO (arXiv 2510.01161) against a float64 reference written from the paper: M2 =
(log pi / pi_behav)^2 per token, the largest masked one at a time until the mean of the rest is
below tau_M2, then the unclipped objective sum_t M_t (pi / pi_behav) A_t / sum |o_i| (here
pi / pi_behav = w r, pi_prox in between). Python floats; tolerance 1e-12 on values and
gradients (float64 throughout).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_objectives import random_inputs
from trainer.config import AlgorithmConfig
from trainer.objectives import LossInputs, policy_loss
from trainer.objectives.m2po import second_moment_mask

TOL = 1e-12


def run(inputs: LossInputs, algorithm: AlgorithmConfig):
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(LossInputs(**{**inputs.__dict__, "logprobs": logprobs}), algorithm)
    loss.backward()
    return loss, logprobs.grad, stats


def paper_mask(m2: list[float], tau: float) -> set[int]:
    """The paper's rule, literally: drop the largest M2 while the mean of the rest is >= tau."""
    left = sorted(range(len(m2)), key=lambda i: -m2[i])
    dropped: set[int] = set()
    while left and sum(m2[i] for i in left) / len(left) >= tau:
        dropped.add(left.pop(0))
    return dropped


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    tau=st.sampled_from([0.01, 0.04, 0.2]),
    decoupled=st.booleans(),
)
def test_m2po_is_the_paper_s_masked_unclipped_objective(seed, tau, decoupled):
    inputs = random_inputs(seed)
    algorithm = AlgorithmConfig(
        objective="m2po", m2po_tau=tau, decoupled=decoupled, behaviour_cap=None
    )
    loss, grad, stats = run(inputs, algorithm)
    proximal = inputs.proximal if decoupled else inputs.behaviour
    lp, prox, behav = inputs.logprobs.tolist(), proximal.tolist(), inputs.behaviour.tolist()  # type: ignore[union-attr]
    adv, mask = inputs.advantages.tolist(), inputs.loss_mask.tolist()
    loss_tokens = [t for t in range(len(lp)) if mask[t]]
    m2 = [(lp[t] - behav[t]) ** 2 for t in loss_tokens]
    dropped = {loss_tokens[i] for i in paper_mask(m2, tau)}
    expected_loss, expected_grad = 0.0, [0.0] * len(lp)
    for t in loss_tokens:
        if t in dropped:
            continue
        ratio = math.exp(lp[t] - prox[t]) * math.exp(prox[t] - behav[t])  # pi / pi_behav
        expected_loss += -ratio * adv[t] / inputs.total_tokens
        expected_grad[t] = -ratio * adv[t] / inputs.total_tokens
    assert abs(loss.item() - expected_loss) <= TOL
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=TOL)
    assert stats["second_moment_masked_tokens"].item() == len(dropped)
    kept = [m2[i] for i, t in enumerate(loss_tokens) if t not in dropped]
    assert not kept or sum(kept) / len(kept) < tau


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(0, 4, allow_nan=False), min_size=0, max_size=30),
    tau=st.floats(1e-3, 1.0),
)
def test_the_mask_is_the_fewest_largest_tokens(values, tau):
    m2 = torch.tensor(values, dtype=torch.float64)
    mask = torch.ones(len(values), dtype=torch.bool)
    dropped = second_moment_mask(m2, mask, tau)
    assert int(dropped.sum()) == len(paper_mask(values, tau))
    if dropped.any() and not dropped.all():
        assert m2[dropped].min() >= m2[~dropped].max()  # only the largest go


def test_tokens_outside_the_mask_are_never_chosen():
    m2 = torch.tensor([9.0, 0.0, 0.01, 5.0], dtype=torch.float64)
    mask = torch.tensor([False, True, True, True])
    assert second_moment_mask(m2, mask, 0.04).tolist() == [False, False, False, True]
