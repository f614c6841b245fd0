"""The objectives table: one entry per `algorithm.objective` choice, one contract for all.

Every entry is run on the same random micro-batch; the checks here are those every entry
must meet whatever its form (statistics, inert masked tokens, the options' refusals). Each
entry's numerics against its paper's definition are in tests/unit/test_objectives_<name>.py
(ppo: tests/unit/test_loss.py).
"""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import AlgorithmConfig, ConfigError, ObjectiveName
from trainer.objectives import OBJECTIVES, STAT_NAMES, LossInputs, policy_loss


def random_inputs(seed: int, n: int = 48, rows: int = 6, dtype=torch.float64) -> LossInputs:
    g = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> torch.Tensor:
        return (torch.rand(n, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)

    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: rows - 1] + 1).values
    sequence_ids = torch.zeros(n, dtype=torch.long)
    for cut in cuts:
        sequence_ids[cut:] += 1
    proximal = uniform(-4.0, -0.05)
    # one advantage per row, as one reward per session gives
    row_advantages = torch.rand(rows, generator=g, dtype=torch.float64) * 4 - 2
    mask = torch.rand(n, generator=g) < 0.8
    return LossInputs(
        logprobs=(proximal + uniform(-0.6, 0.6)).requires_grad_(True),
        proximal=proximal,
        behaviour=proximal + uniform(-0.8, 0.8),
        advantages=row_advantages[sequence_ids].to(dtype),
        loss_mask=mask,
        sequence_ids=sequence_ids,
        entropy=uniform(0.1, 3.0),
        reference=proximal + uniform(-0.5, 0.5),
        total_tokens=float(mask.sum()) + 7.0,  # other micro-batches' tokens too
        total_sequences=float(rows) + 2.0,
    )


def test_the_table_is_the_config_choice():
    assert set(OBJECTIVES) == set(typing.get_args(ObjectiveName))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_returns_every_statistic_detached(name):
    inputs = random_inputs(0)
    loss, stats = policy_loss(inputs, AlgorithmConfig(objective=name, kl_coef=0.1))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(stats) == set(STAT_NAMES)
    assert all(not v.requires_grad and torch.isfinite(v) for v in stats.values())
    assert stats["tokens"].item() == inputs.loss_mask.sum().item()


ABSURD = [1e4, -1e4, math.inf, -math.inf, math.nan]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(sorted(OBJECTIVES)),
    where=st.sampled_from(["logprobs", "proximal", "behaviour", "reference", "entropy"]),
    value=st.sampled_from(ABSURD),
    aggregation=st.sampled_from(["token_mean", "sequence_mean", "constant"]),
)
def test_masked_tokens_with_absurd_values_change_nothing(seed, name, where, value, aggregation):
    """Any objective, any aggregation, with the KL and entropy terms on: a masked token's
    values never reach the loss, its gradient is exactly 0, and nothing is NaN."""
    algorithm = AlgorithmConfig(
        objective=name,
        kl_coef=0.1,
        entropy_coef=0.01,
        aggregation=aggregation,
        aggregation_constant=32.0 if aggregation == "constant" else None,
    )
    clean = random_inputs(seed)
    masked = torch.nonzero(~clean.loss_mask).flatten()
    if masked.numel() == 0:
        return
    poisoned = {k: getattr(clean, k).detach().clone() for k in (where, "logprobs")}
    poisoned[where][masked] = value
    results = []
    for inputs in (clean, LossInputs(**{**clean.__dict__, **poisoned})):
        logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
        loss, stats = policy_loss(
            LossInputs(**{**inputs.__dict__, "logprobs": logprobs}), algorithm
        )
        loss.backward()
        results.append((loss, logprobs.grad, stats))
    (clean_loss, clean_grad, _), (loss, grad, stats) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == clean_loss.item()
    assert torch.equal(grad, clean_grad) and (grad[masked] == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"objective": "ppo2"}, "algorithm.objective"),
        ({"entropy_coef": -0.1}, "algorithm.entropy_coef"),
        ({"entropy_coef": math.nan}, "algorithm.entropy_coef"),
        ({"entropy_coef": math.inf}, "algorithm.entropy_coef"),
        ({"kl_coef": math.nan}, "algorithm.kl_coef"),
        ({"kl_estimator": "k4"}, "algorithm.kl_estimator"),
        ({"aggregation": "sum"}, "algorithm.aggregation"),
        ({"objective": "sapo", "sapo_tau_pos": 0.0}, "algorithm.sapo_tau_pos"),
        ({"objective": "sapo", "sapo_tau_neg": math.inf}, "algorithm.sapo_tau_neg"),
        ({"sapo_tau_neg": 2.0}, "algorithm.sapo_tau_neg"),  # not under objective=ppo
        ({"objective": "m2po", "m2po_tau": -0.1}, "algorithm.m2po_tau"),
        ({"objective": "gspo", "m2po_tau": 0.1}, "algorithm.m2po_tau"),
        ({"aggregation": "constant"}, "algorithm.aggregation_constant"),
        ({"aggregation_constant": 10.0}, "algorithm.aggregation_constant"),
        (
            {"aggregation": "constant", "aggregation_constant": 0.0},
            "algorithm.aggregation_constant",
        ),
        (
            {"aggregation": "constant", "aggregation_constant": math.inf},
            "algorithm.aggregation_constant",
        ),
    ],
)
def test_bad_options_are_refused_when_the_algorithm_is_made(options, field):
    with pytest.raises(ConfigError) as caught:
        AlgorithmConfig(**options)
    assert caught.value.field_name == field


@pytest.mark.parametrize(
    ("options", "missing", "match"),
    [
        ({"entropy_coef": 0.1}, "entropy", "entropy_coef"),
        ({"kl_coef": 0.1}, "reference", "kl_coef"),
        ({"decoupled": True}, "proximal", "proximal"),
    ],
)
def test_an_option_without_its_input_is_refused(options, missing, match):
    inputs = LossInputs(**{**random_inputs(1).__dict__, missing: None})
    with pytest.raises(ValueError, match=match):
        policy_loss(inputs, AlgorithmConfig(**options))


def test_a_sequence_aggregation_without_sequences_is_refused():
    inputs = LossInputs(**{**random_inputs(2).__dict__, "total_sequences": 0.0})
    with pytest.raises(ValueError, match="total_sequences"):
        policy_loss(inputs, AlgorithmConfig(aggregation="sequence_mean"))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("behaviour", [-100.0, -1e4, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_a_loss_token_with_an_absurd_behaviour_logprob_sends_no_nan_back(
    name, behaviour, dtype, cap
):
    """A *loss* token whose pi_prox / pi_behav overflows (a broken engine logprob): every
    objective's loss and gradient stay finite, capped / masked or not."""
    inputs = random_inputs(3, dtype=dtype)
    poisoned = inputs.behaviour.clone()
    poisoned[torch.nonzero(inputs.loss_mask)[0]] = behaviour
    logprobs = inputs.logprobs.detach().clone().requires_grad_(True)
    given = LossInputs(**{**inputs.__dict__, "behaviour": poisoned, "logprobs": logprobs})
    loss, stats = policy_loss(given, AlgorithmConfig(objective=name, behaviour_cap=cap))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
