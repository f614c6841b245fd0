"""The figures of gspo's and m2po's own statistics reach a step's record and the trackers.

`policy_loss` sums ``clipped_sequences`` (gspo: rows whose sequence ratio was clipped) and
``second_moment_masked_tokens`` (m2po: loss tokens masked to bound the second moment); the step's
figures (trainer/figures.py) carry them as ``clipped_sequences`` and
``second_moment_masked_fraction`` (over the step's loss tokens), and the trackers file them under
``policy/`` and ``behaviour/``. Checked here against the objectives' own sums, counted by hand
from the sequences' ratios where that is simple (gspo).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import AlgorithmConfig
from trainer.figures import _update_figures
from trainer.objectives import LossInputs, policy_loss
from trainer.tracking import scalars


def inputs(seed: int, drift: float) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    size = 48
    proximal = -torch.rand(size, generator=g, dtype=torch.float64) * 3
    sequence_ids = torch.arange(size) // 8  # six rows of eight tokens
    return LossInputs(
        logprobs=proximal + torch.randn(size, generator=g, dtype=torch.float64) * drift,
        proximal=proximal,
        behaviour=proximal + torch.randn(size, generator=g, dtype=torch.float64) * drift,
        advantages=torch.randn(6, generator=g, dtype=torch.float64)[sequence_ids],
        loss_mask=torch.ones(size, dtype=torch.bool),
        sequence_ids=sequence_ids,
        entropy=None,
        reference=None,
        total_tokens=float(size),
        total_sequences=6.0,
    )


def figures_of(stats: dict[str, torch.Tensor]) -> dict[str, Any]:
    tokens = int(stats["tokens"])
    sums = {key: float(value) for key, value in stats.items()} | {"grad_norms": [1.0]}
    return _update_figures(sums, tokens, reference_kl=False)


def test_gspo_reports_its_clipped_sequences():
    algorithm = AlgorithmConfig(objective="gspo", eps_clip=0.05, aggregation="sequence_mean")
    given = inputs(0, drift=0.3)
    _, stats = policy_loss(given, algorithm)
    log_ratio = given.logprobs - given.proximal
    ratios = [float(log_ratio[given.sequence_ids == row].mean().exp()) for row in range(6)]
    advantages = [float(given.advantages[given.sequence_ids == row][0]) for row in range(6)]
    clipped = sum(
        (a > 0 and r > 1 + 0.05) or (a < 0 and r < 1 - 0.05)
        for r, a in zip(ratios, advantages, strict=True)
    )
    assert clipped > 0  # the inputs were drawn so that some rows clip
    figures = figures_of(stats)
    assert figures["clipped_sequences"] == clipped
    assert scalars(figures)["policy/clipped_sequences"] == clipped


def test_m2po_reports_its_masked_share():
    algorithm = AlgorithmConfig(objective="m2po", behaviour_cap=None)
    _, stats = policy_loss(inputs(1, drift=0.8), algorithm)
    masked = float(stats["second_moment_masked_tokens"])
    assert masked > 0  # a drift of 0.8 nats is far past the default tau
    figures = figures_of(stats)
    assert figures["second_moment_masked_fraction"] == masked / 48
    assert scalars(figures)["behaviour/second_moment_masked_fraction"] == masked / 48


def test_other_objectives_report_zero_for_both():
    _, stats = policy_loss(inputs(2, drift=0.3), AlgorithmConfig())
    figures = figures_of(stats)
    assert figures["clipped_sequences"] == 0 and figures["second_moment_masked_fraction"] == 0


def test_the_critic_s_sums_become_its_figures():
    """The critic's sums (trainer/algorithm.py's value_term) per loss token of the step, under
    critic/ in the trackers; absent without the critic."""
    sums = {"tokens": 10.0, "kept_tokens": 10.0, "grad_norms": [1.0]}
    critic = {"value_loss_sum": 2.5, "value_clipped_tokens": 3.0, "value_sum": -4.0}
    figures = _update_figures(sums | critic | {"return_sum": 6.0}, 10, reference_kl=False)
    assert figures["value_loss"] == 0.25 and figures["value_clip_fraction"] == 0.3
    assert figures["value_mean"] == -0.4 and figures["value_target_mean"] == 0.6
    assert scalars(figures)["critic/value_loss"] == 0.25
    assert scalars(figures)["critic/target_mean"] == 0.6
    assert "value_loss" not in _update_figures(sums, 10, reference_kl=False)
