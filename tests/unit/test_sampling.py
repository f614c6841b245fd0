"""Sampling: logprobs of the sampled token under the temperature-scaled full distribution."""

from __future__ import annotations

import math

import pytest
import torch

from server.engine.sampling import RowSampling, sample, scaled_log_probs, top_logprobs

VOCAB = 50


def reference_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    t = 1.0 if temperature < 1e-6 else temperature
    return torch.log_softmax(logits.double() / t, dim=-1)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_logprobs_match_a_float64_reference(logits):
    rows = [RowSampling(temperature=t) for t in (1.0, 0.7, 1.3, 0.0, 0.25, 2.0)]
    uniforms = torch.rand(
        len(rows), dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    result = sample(logits, rows, uniforms)
    for i, row in enumerate(rows):
        expected = reference_log_probs(logits[i], row.temperature)[result.tokens[i]]
        assert abs(result.logprobs[i].item() - expected.item()) < 1e-5


def test_greedy_takes_the_argmax(logits):
    rows = [RowSampling(temperature=0.0)] * len(logits)
    result = sample(logits, rows, torch.rand(len(rows), dtype=torch.float64))
    assert result.tokens.tolist() == logits.argmax(-1).tolist()


def test_inverse_cdf_picks_the_token_whose_interval_holds_the_uniform():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    picks = [
        sample(logits, [RowSampling()], torch.tensor([u], dtype=torch.float64)).tokens.item()
        for u in (0.0, 0.05, 0.1001, 0.299, 0.31, 0.59, 0.61, 0.999)
    ]
    assert picks == [0, 0, 1, 1, 2, 2, 3, 3]


def test_top_k_top_p_min_p_narrow_the_draw_not_the_logprob():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    cases = [
        (RowSampling(top_k=1), {0}),
        (RowSampling(top_k=2), {0, 1}),
        (RowSampling(top_p=0.7), {0, 1}),  # 0.5 < 0.7, then 0.8 >= 0.7: keep two
        (RowSampling(top_p=0.45), {0}),
        (RowSampling(min_p=0.35), {0, 1}),  # 0.15 < 0.35 * 0.5
    ]
    uniforms = torch.linspace(0, 0.9999, 200, dtype=torch.float64)
    for rule, allowed in cases:
        drawn = {sample(logits, [rule], u.reshape(1)).tokens.item() for u in uniforms}
        assert drawn == allowed, rule
        result = sample(logits, [rule], torch.tensor([0.9], dtype=torch.float64))
        token = result.tokens.item()
        assert abs(result.logprobs.item() - math.log(probs[0, token].item())) < 1e-6


def test_empirical_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().expand(4000, 4)
    uniforms = torch.rand(4000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tokens = sample(logits, [RowSampling()] * 4000, uniforms).tokens
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    # 4 standard errors at n=4000 is below 0.031 for every p here.
    assert (freq - probs.double()).abs().max() < 0.031


def test_scaled_log_probs_treats_greedy_as_temperature_one(logits):
    out = scaled_log_probs(logits, torch.tensor([0.0] * len(logits)))
    assert torch.allclose(out.double(), torch.log_softmax(logits.double(), -1), atol=1e-6)


def test_top_logprobs_are_sorted_and_exact(logits):
    log_probs = torch.log_softmax(logits, -1)
    top = top_logprobs(log_probs, 3)
    for row, entries in zip(log_probs, top, strict=True):
        ids = [i for _, i in entries]
        assert ids == row.topk(3).indices.tolist()
        assert [lp for lp, _ in entries] == pytest.approx(row.topk(3).values.tolist())
