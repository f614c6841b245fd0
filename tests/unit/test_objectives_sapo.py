"""SAPO (arXiv 2511.20347) against a float64 reference written from the paper's soft gate,
f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau = tau_pos for A > 0 and tau_neg otherwise, the
objective f(r) A per token; its derivative f'(r) = 4 sigmoid (1 - sigmoid) by hand, in Python
floats. Tolerance: 1e-12 on values and gradients (float64 throughout).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_objectives import random_inputs
from trainer.config import AlgorithmConfig
from trainer.objectives import LossInputs, policy_loss

TOL = 1e-12


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def run(inputs: LossInputs, algorithm: AlgorithmConfig):
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(LossInputs(**{**inputs.__dict__, "logprobs": logprobs}), algorithm)
    loss.backward()
    return loss, logprobs.grad, stats


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    taus=st.sampled_from([(1.0, 1.05), (0.5, 2.0), (3.0, 3.0)]),
    decoupled=st.booleans(),
)
def test_sapo_is_the_paper_s_soft_gate(seed, taus, decoupled):
    inputs = random_inputs(seed)
    tau_pos, tau_neg = taus
    algorithm = AlgorithmConfig(
        objective="sapo",
        sapo_tau_pos=tau_pos,
        sapo_tau_neg=tau_neg,
        decoupled=decoupled,
        behaviour_cap=None,
    )
    loss, grad, stats = run(inputs, algorithm)
    proximal = inputs.proximal if decoupled else inputs.behaviour
    lp, old, behav = inputs.logprobs.tolist(), proximal.tolist(), inputs.behaviour.tolist()  # type: ignore[union-attr]
    adv, mask = inputs.advantages.tolist(), inputs.loss_mask.tolist()
    expected_loss, expected_grad = 0.0, [0.0] * len(lp)
    for t in range(len(lp)):
        if not mask[t]:
            continue
        r = math.exp(lp[t] - old[t])
        w = math.exp(old[t] - behav[t])  # 1 under plain PPO
        tau = tau_pos if adv[t] > 0 else tau_neg
        gate = sigmoid(tau * (r - 1)) * 4 / tau
        slope = 4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1)))  # f'(r)
        expected_loss += -w * gate * adv[t] / inputs.total_tokens
        expected_grad[t] = -w * slope * r * adv[t] / inputs.total_tokens  # dr/dlogpi = r
    assert abs(loss.item() - expected_loss) <= TOL
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=TOL)
    assert stats["clipped_tokens"].item() == 0


def test_on_policy_the_gate_gives_the_plain_policy_gradient_and_fades_away_from_it():
    """At r = 1 the gate's slope is 1 whatever tau: the gradient is -A / T, as REINFORCE's.
    At r = 3 the gradient of a positive-advantage token is a small fraction of it, and smaller
    for the larger temperature (tau_neg > tau_pos damps negative advantages harder)."""
    logprobs = torch.tensor([-1.0, -1.0, -1.0 + math.log(3), -1.0 + math.log(3)])
    inputs = LossInputs(
        logprobs=logprobs.double(),
        proximal=torch.full((4,), -1.0, dtype=torch.float64),
        behaviour=torch.full((4,), -1.0, dtype=torch.float64),
        advantages=torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64),
        loss_mask=torch.ones(4, dtype=torch.bool),
        sequence_ids=torch.arange(4),
        entropy=None,
        reference=None,
        total_tokens=4.0,
        total_sequences=4.0,
    )
    _, grad, _ = run(inputs, AlgorithmConfig(objective="sapo", sapo_tau_pos=1.0))
    assert abs(grad[0].item() - -0.25) <= TOL and abs(grad[1].item() - 0.25) <= TOL
    assert 0 > grad[2].item() > -0.25 * 3 * 0.5
    _, sharper, _ = run(inputs, AlgorithmConfig(objective="sapo", sapo_tau_pos=4.0))
    assert abs(sharper[0].item() - -0.25) <= TOL
    assert abs(sharper[2].item()) < abs(grad[2].item())
