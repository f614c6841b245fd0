"""Token sampling with exact logprobs, batched over the running requests.

The logprob reported for a sampled token is ``log_softmax(logits / temperature)[token]`` over the
full vocabulary: the distribution the trainer recomputes from the same weights. ``top_k``,
``top_p`` and ``min_p`` narrow what can be *drawn*, not the reported logprob (as in SGLang, whose
logprobs are taken after temperature and before truncation). Greedy requests (temperature below
1e-6) use temperature 1 and take the arg-max, as SGLang does.

Each request draws one uniform number per step, from its own generator when it set
``sampling_seed`` (so its samples do not depend on what else is in the batch) or else from the
engine's. This module knows nothing about requests, HTTP or the model; it maps logits to tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class RowSampling:
    """How one row of logits is turned into a token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: logprob of each sampled token
    log_probs: torch.Tensor  # [B, V] float32: the full distribution, for top-k / token-id logprobs


def scaled_log_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row in float32; greedy rows use T = 1."""
    temps = torch.where(
        temperatures < GREEDY_TEMPERATURE, torch.ones_like(temperatures), temperatures
    )
    return torch.log_softmax(logits.float() / temps.unsqueeze(-1), dim=-1)


def _truncate(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Zero the probabilities that top_k / top_p / min_p exclude, row by row."""
    device = probs.device
    top_k = torch.tensor([r.top_k if r.top_k > 0 else probs.shape[-1] for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=probs.dtype, device=device)
    min_p = torch.tensor([r.min_p for r in rows], dtype=probs.dtype, device=device)

    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=device).unsqueeze(0)
    # Keep a token if it is among the top k, and the mass before it is below top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k.unsqueeze(-1)) & (mass_before < top_p.unsqueeze(-1))
    keep &= sorted_probs >= (min_p * sorted_probs[:, 0]).unsqueeze(-1)
    keep[:, 0] = True  # the most likely token always stays
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return kept


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from unnormalised ``probs`` with the given uniforms in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.to(cdf.dtype) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).squeeze(-1)
    # Never land on a zero-probability token at the very end from float round-off.
    return tokens.clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    uniforms: torch.Tensor,
) -> SampleResult:
    """Sample one token per row of ``logits`` [B, V]; ``uniforms`` [B] are that step's draws."""
    device = logits.device
    temperatures = torch.tensor([r.temperature for r in rows], device=device)
    log_probs = scaled_log_probs(logits, temperatures)
    probs = log_probs.exp()
    truncating = [i for i, r in enumerate(rows) if r.truncates and not r.greedy]
    if truncating:
        index = torch.tensor(truncating, device=device)
        probs[index] = _truncate(probs[index], [rows[i] for i in truncating])
    tokens = _inverse_cdf(probs, uniforms.to(device))
    greedy = torch.tensor([r.greedy for r in rows], device=device)
    if greedy.any():
        tokens = torch.where(greedy, log_probs.argmax(dim=-1), tokens)
    logprobs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return SampleResult(tokens=tokens, logprobs=logprobs, log_probs=log_probs)


def top_logprobs(log_probs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The ``k`` most likely tokens of each row as (logprob, token id), most likely first."""
    values, ids = log_probs.topk(k, dim=-1)
    return [
        list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]
