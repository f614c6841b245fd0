"""GSPO (arXiv 2507.18071) against a float64 reference written from the paper: §4.1's
sequence ratio s_i = exp(mean_t log(pi / pi_old)) and objective (1/G) sum_i min(s_i A_i,
clip(s_i, 1 - eps, 1 + eps) A_i), differentiated by torch.autograd; and, for the decoupled
form's per-token behaviour weight, §4.3's GSPO-token gradient s_i A_i (1/|y_i|) w_t
grad log pi(y_i,t) written out in Python floats.

Tolerance: 1e-12 on values and gradients (float64 throughout).
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


def run(inputs: LossInputs, algorithm: AlgorithmConfig):
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(LossInputs(**{**inputs.__dict__, "logprobs": logprobs}), algorithm)
    loss.backward()
    return loss, logprobs.grad, stats


def paper_gspo(
    inputs: LossInputs, old: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-J_GSPO, one row at a time (§4.1), normalised by the minibatch's rows; its gradient."""
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    loss = torch.zeros((), dtype=torch.float64)
    for row in torch.unique(inputs.sequence_ids).tolist():
        tokens = (inputs.sequence_ids == row) & inputs.loss_mask
        if not tokens.any():
            continue
        s = torch.exp((logprobs[tokens] - old[tokens]).mean())
        a = inputs.advantages[tokens][0]  # one advantage per row, as the paper has
        loss = loss - torch.minimum(s * a, torch.clamp(s, 1 - eps, 1 + eps) * a)
    loss = loss / inputs.total_sequences
    loss.backward()
    return loss.detach(), logprobs.grad


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.sampled_from([0.05, 0.1, 0.3]))
def test_gspo_is_the_paper_s_sequence_objective(seed, eps):
    """Plain (pi_old = pi_behav) and with aggregation sequence_mean: the paper's GSPO."""
    inputs = random_inputs(seed)
    algorithm = AlgorithmConfig(
        objective="gspo", decoupled=False, eps_clip=eps, aggregation="sequence_mean"
    )
    loss, grad, _ = run(inputs, algorithm)
    expected, expected_grad = paper_gspo(inputs, inputs.behaviour, eps)
    assert abs(loss.item() - expected.item()) <= TOL
    assert torch.allclose(grad, expected_grad, rtol=0, atol=TOL)
    assert (grad[~inputs.loss_mask] == 0).all()


def test_decoupled_gspo_is_centred_on_the_proximal_policy_with_token_weights():
    """§4.3's gradient with w_t = pi_prox / pi_behav per token: row i's token t gets
    -(1/S) (1/|y_i|) w_t A_i s_i when s_i is inside the clip range for A_i's sign, else 0."""
    for seed in range(5):
        inputs = random_inputs(seed)
        eps = 0.1
        algorithm = AlgorithmConfig(
            objective="gspo", eps_clip=eps, behaviour_cap=None, aggregation="sequence_mean"
        )
        loss, grad, _ = run(inputs, algorithm)
        lp, prox = inputs.logprobs.tolist(), inputs.proximal.tolist()  # type: ignore[union-attr]
        behav, adv = inputs.behaviour.tolist(), inputs.advantages.tolist()
        mask, ids = inputs.loss_mask.tolist(), inputs.sequence_ids.tolist()
        expected_loss, expected_grad = 0.0, [0.0] * len(lp)
        for row in set(ids):
            tokens = [t for t in range(len(lp)) if ids[t] == row and mask[t]]
            if not tokens:
                continue
            s = math.exp(sum(lp[t] - prox[t] for t in tokens) / len(tokens))
            a = adv[tokens[0]]
            clipped = (a > 0 and s > 1 + eps) or (a < 0 and s < 1 - eps)
            value = -min(s * a, min(max(s, 1 - eps), 1 + eps) * a)
            for t in tokens:
                w = math.exp(prox[t] - behav[t])
                expected_loss += w * value / len(tokens) / inputs.total_sequences
                if not clipped:
                    expected_grad[t] = -w * a * s / len(tokens) / inputs.total_sequences
        assert abs(loss.item() - expected_loss) <= TOL
        assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), atol=TOL)


def test_the_clip_is_per_sequence():
    """Row 0's mean log ratio is log 1.5 (clipped for A > 0) though its first token's own ratio
    is 1: GSPO gives the whole row no gradient where token-level PPO would train that token.
    Row 1 (s = 1) trains every token."""
    proximal = torch.full((5,), -1.0, dtype=torch.float64)
    shift = torch.tensor([0.0, 2 * math.log(1.5), 0.0, 0.0, 0.0], dtype=torch.float64)
    inputs = LossInputs(
        logprobs=proximal + shift,
        proximal=proximal,
        behaviour=proximal.clone(),
        advantages=torch.ones(5, dtype=torch.float64),
        loss_mask=torch.ones(5, dtype=torch.bool),
        sequence_ids=torch.tensor([0, 0, 1, 1, 1]),
        entropy=None,
        reference=None,
        total_tokens=5.0,
        total_sequences=2.0,
    )
    _, grad, stats = run(inputs, AlgorithmConfig(objective="gspo"))
    assert grad[:2].abs().sum() == 0 and (grad[2:] != 0).all()
    assert stats["clipped_sequences"].item() == 1 and stats["clipped_tokens"].item() == 2
    assert abs(stats["ratio_sum"].item() - (1.5 * 2 + 3)) <= TOL
    _, ppo_grad, _ = run(inputs, AlgorithmConfig(objective="ppo"))
    assert ppo_grad[0] != 0


def test_a_token_the_behaviour_mask_removes_leaves_its_row_s_ratio():
    """token_mask drops token 1 (weight e^2 > cap 2): s_0 is the mean over tokens 0 and 2."""
    proximal = torch.full((3,), -1.0, dtype=torch.float64)
    inputs = LossInputs(
        logprobs=proximal + torch.tensor([0.02, 5.0, 0.04], dtype=torch.float64),
        proximal=proximal,
        behaviour=proximal - torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64),
        advantages=torch.ones(3, dtype=torch.float64),
        loss_mask=torch.ones(3, dtype=torch.bool),
        sequence_ids=torch.zeros(3, dtype=torch.long),
        entropy=None,
        reference=None,
        total_tokens=3.0,
        total_sequences=1.0,
    )
    algorithm = AlgorithmConfig(objective="gspo", behaviour_cap=2.0, behaviour_mode="token_mask")
    loss, grad, stats = run(inputs, algorithm)
    s = math.exp(0.03)
    assert abs(loss.item() - -2 * s / 3) <= TOL
    assert grad[1] == 0 and stats["behaviour_masked_tokens"].item() == 1
