"""The cross-cutting terms of every objective, against float64 references written from their
papers: the aggregations (token mean; GRPO's sequence mean, arXiv 2402.03300 eq. 3; Dr. GRPO's
constant normaliser, arXiv 2503.20783 Fig. 1 and its code), the entropy bonus, and the KL
estimators (Schulman, "Approximating KL Divergence", 2020).

Tolerances: float64 values and autograd gradients agree with the reference to 1e-12; exact
expectations over a small vocabulary to 1e-12. The sampled KL gradients are checked within 5
standard errors of the exact gradient (the per-sample gradients' std / sqrt(N), estimated from
the same samples), a bound a correct estimator misses with probability below 1e-5 per
component, while the wrong direction misses it by far more (asserted).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import AlgorithmConfig
from trainer.objectives import LossInputs, policy_loss
from trainer.objectives.kl import KL_ESTIMATORS, kl_estimate

TOL = 1e-12


def case(seed: int, n: int = 40, rows: int = 5) -> LossInputs:
    """Plain PPO (proximal = behaviour) inside the trust region is -A r per token: a simple
    per-token term whose aggregation is what is under test."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: rows - 1] + 1).values
    sequence_ids = torch.zeros(n, dtype=torch.long)
    for cut in cuts:
        sequence_ids[cut:] += 1
    behaviour = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.1
    mask = torch.rand(n, generator=g) < 0.75
    mask[torch.searchsorted(sequence_ids, torch.arange(rows))] = True  # every row has a loss token
    return LossInputs(
        logprobs=behaviour + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.2,
        proximal=None,
        behaviour=behaviour,
        advantages=torch.randn(n, generator=g, dtype=torch.float64),
        loss_mask=mask,
        sequence_ids=sequence_ids,
        entropy=torch.rand(n, generator=g, dtype=torch.float64) * 2,
        reference=behaviour + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5),
        total_tokens=float(mask.sum()) + 5,
        total_sequences=float(rows) + 1,
    )


def reference_loss(inputs: LossInputs, logprobs, entropy, aggregation, constant, coef):
    """The loss written from the papers, row by row: per token -A r (inside the clip range),
    minus coef * entropy; aggregated as
      token_mean:     sum over the batch's tokens / T
      sequence_mean:  (1 / S) sum_i (1 / |o_i|) sum_t          (GRPO eq. 3)
      constant:       (1 / S) sum_i (1 / C) sum_t               (Dr. GRPO)."""
    ratio = torch.exp(logprobs - inputs.behaviour)
    per_token = -inputs.advantages * ratio - coef * entropy
    total = torch.zeros((), dtype=torch.float64)
    for row in torch.unique(inputs.sequence_ids):
        in_row = (inputs.sequence_ids == row) & inputs.loss_mask
        row_sum = per_token[in_row].sum()
        if aggregation == "token_mean":
            total = total + row_sum / inputs.total_tokens
        elif aggregation == "sequence_mean":
            total = total + row_sum / in_row.sum() / inputs.total_sequences
        else:
            total = total + row_sum / constant / inputs.total_sequences
    return total


AGGREGATIONS = [("token_mean", None), ("sequence_mean", None), ("constant", 16.0)]


def algorithm_for(aggregation, constant, entropy_coef=0.0, **options):
    return AlgorithmConfig(
        decoupled=False,
        eps_clip=0.5,  # |log r| <= 0.1: inside the clip range, the term is -A r
        aggregation=aggregation,
        aggregation_constant=constant,
        entropy_coef=entropy_coef,
        **options,
    )


def loss_and_grads(inputs: LossInputs, algorithm: AlgorithmConfig):
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    assert inputs.entropy is not None
    entropy = inputs.entropy.detach().clone().requires_grad_(True)
    given = LossInputs(**{**inputs.__dict__, "logprobs": logprobs, "entropy": entropy})
    loss, stats = policy_loss(given, algorithm)
    loss.backward()
    return loss, logprobs.grad, entropy.grad, stats


@pytest.mark.parametrize(("aggregation", "constant"), AGGREGATIONS)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregation_and_entropy_bonus_match_the_papers(aggregation, constant, entropy_coef, seed):
    inputs = case(seed)
    algorithm = algorithm_for(aggregation, constant, entropy_coef)
    loss, grad, entropy_grad, _ = loss_and_grads(inputs, algorithm)
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    entropy = inputs.entropy.detach().clone().requires_grad_(True)
    expected = reference_loss(inputs, logprobs, entropy, aggregation, constant, entropy_coef)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= TOL
    assert torch.allclose(grad, logprobs.grad, rtol=0, atol=TOL)
    if entropy_coef:
        assert torch.allclose(entropy_grad, entropy.grad, rtol=0, atol=TOL)
        assert entropy_grad[~inputs.loss_mask].abs().sum() == 0
    else:
        assert entropy_grad is None  # the bonus off: entropy takes no part in the loss


def test_the_aggregations_weigh_rows_as_their_papers_say():
    """Two rows, one token of advantage 1 and three of advantage 1: token_mean weighs each
    token 1/4, sequence_mean each row 1/2 (the lone token 1/2, the others 1/6 each),
    constant each token 1/(C S)."""
    inputs = LossInputs(
        logprobs=torch.full((4,), -1.0, dtype=torch.float64).requires_grad_(True),
        proximal=None,
        behaviour=torch.full((4,), -1.0, dtype=torch.float64),
        advantages=torch.ones(4, dtype=torch.float64),
        loss_mask=torch.ones(4, dtype=torch.bool),
        sequence_ids=torch.tensor([0, 1, 1, 1]),
        entropy=None,
        reference=None,
        total_tokens=4.0,
        total_sequences=2.0,
    )
    expected = {
        ("token_mean", None): [-1 / 4] * 4,
        ("sequence_mean", None): [-1 / 2, -1 / 6, -1 / 6, -1 / 6],
        ("constant", 8.0): [-1 / 16] * 4,
    }
    for (aggregation, constant), grad in expected.items():
        logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(
            LossInputs(**{**inputs.__dict__, "logprobs": logprobs}),
            algorithm_for(aggregation, constant),
        )
        loss.backward()
        assert torch.allclose(logprobs.grad, torch.tensor(grad, dtype=torch.float64), atol=TOL)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    choice=st.sampled_from(range(len(AGGREGATIONS))),
    parts=st.integers(2, 4),
)
def test_micro_batch_shares_sum_to_the_minibatch_loss(seed, choice, parts):
    """Every normaliser is a global total: the loss of micro-batches cut on row boundaries sums
    to the loss of the whole, whatever the aggregation."""
    inputs = case(seed, n=48, rows=8)
    algorithm = algorithm_for(*AGGREGATIONS[choice], entropy_coef=0.05, kl_coef=0.1)
    whole, whole_grad, _, _ = loss_and_grads(inputs, algorithm)
    starts = torch.searchsorted(inputs.sequence_ids, torch.arange(8)).tolist()
    bounds = [0, *sorted(set(starts[1:]))[:: max(1, 8 // parts)][1:], 48]
    total, grads = 0.0, []
    for start, end in itertools.pairwise(sorted(set(bounds))):
        part = {
            k: (v[start:end] if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.__dict__.items()
        }
        part["sequence_ids"] = part["sequence_ids"] - part["sequence_ids"][0]
        loss, grad, _, _ = loss_and_grads(LossInputs(**part), algorithm)
        total += loss.item()
        grads.append(grad)
    assert abs(total - whole.item()) <= TOL
    assert torch.allclose(torch.cat(grads), whole_grad, rtol=0, atol=TOL)


# --- KL estimators: which KL each one's gradient is ------------------------------------------


def distributions(seed: int, vocabulary: int = 7):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocabulary, generator=g, dtype=torch.float64).requires_grad_(True)
    reference = torch.log_softmax(torch.randn(vocabulary, generator=g, dtype=torch.float64), 0)
    return theta, reference


def exact_kl_gradients(theta, reference):
    """grad_theta of KL(pi || ref) = sum pi (log pi - log ref), and of KL(ref || pi) =
    sum ref (log ref - log pi), by autograd on their definitions."""
    out = {}
    for name in ("pi||ref", "ref||pi"):
        log_pi = torch.log_softmax(theta, 0)
        if name == "pi||ref":
            kl = (log_pi.exp() * (log_pi - reference)).sum()
        else:
            kl = (reference.exp() * (reference - log_pi)).sum()
        out[name] = torch.autograd.grad(kl, theta)[0]
    return out


NAMED = {"k1": None, "k2": "pi||ref", "k3": "ref||pi"}  # None: expected gradient 0


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_estimator_s_expected_gradient_is_that_of_the_kl_it_names(estimator, seed):
    """Exactly, over the whole vocabulary: E_{x~pi}[grad k(x)] = sum_x sg[pi(x)] grad k(x)."""
    theta, reference = distributions(seed)
    exact = exact_kl_gradients(theta, reference)
    log_pi = torch.log_softmax(theta, 0)
    expected_loss = (log_pi.exp().detach() * kl_estimate(estimator, log_pi, reference)).sum()
    gradient = torch.autograd.grad(expected_loss, theta)[0]
    named = NAMED[estimator]
    target = torch.zeros_like(gradient) if named is None else exact[named]
    assert torch.allclose(gradient, target, rtol=0, atol=TOL)
    other = exact["ref||pi" if named == "pi||ref" else "pi||ref"]
    assert (gradient - other).abs().max() > 1e-3  # and not the other direction's


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_and_k3_values_are_unbiased_for_kl_pi_ref(estimator):
    theta, reference = distributions(3)
    log_pi = torch.log_softmax(theta, 0).detach()
    value = (log_pi.exp() * kl_estimate(estimator, log_pi, reference)).sum()
    assert abs(value.item() - (log_pi.exp() * (log_pi - reference)).sum().item()) <= TOL


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_the_loss_s_kl_term_sampled_from_pi_has_the_named_gradient(estimator):
    """Through policy_loss, tokens sampled from pi: kl_coef * mean k over N samples, its
    gradient within 5 standard errors of the exact one (and k3's far from KL(pi || ref)'s,
    which the old docstring named)."""
    theta, reference = distributions(4, vocabulary=5)
    n = 20_000
    tokens = torch.multinomial(
        torch.softmax(theta.detach(), 0),
        n,
        replacement=True,
        generator=torch.Generator().manual_seed(5),
    )
    log_pi = torch.log_softmax(theta, 0)[tokens]
    zeros = torch.zeros(n, dtype=torch.float64)
    inputs = LossInputs(
        logprobs=log_pi,
        proximal=None,
        behaviour=log_pi.detach(),
        advantages=zeros,  # the policy term is 0: only the KL term remains
        loss_mask=torch.ones(n, dtype=torch.bool),
        sequence_ids=torch.arange(n),
        entropy=None,
        reference=reference[tokens],
        total_tokens=float(n),
        total_sequences=float(n),
    )
    algorithm = AlgorithmConfig(decoupled=False, kl_coef=1.0, kl_estimator=estimator)
    loss, _ = policy_loss(inputs, algorithm)
    gradient = torch.autograd.grad(loss, theta)[0]
    # per-sample gradients: d k(x)/d theta = k'(log pi(x)) (onehot(x) - pi)
    log_ratio = (torch.log_softmax(theta, 0) - reference).detach()[tokens]
    slope = {"k1": torch.ones_like(log_ratio), "k2": log_ratio, "k3": 1 - torch.exp(-log_ratio)}
    onehot = torch.nn.functional.one_hot(tokens, theta.numel()).double()
    samples = slope[estimator][:, None] * (onehot - torch.softmax(theta.detach(), 0))
    assert torch.allclose(samples.mean(0), gradient, rtol=0, atol=TOL)  # the loss's gradient
    standard_error = samples.std(0) / n**0.5
    exact = exact_kl_gradients(theta, reference)
    named = NAMED[estimator]
    target = torch.zeros_like(gradient) if named is None else exact[named]
    assert ((gradient - target).abs() <= 5 * standard_error).all()
    if estimator == "k3":
        assert ((gradient - exact["pi||ref"]).abs() > 5 * standard_error).any()
