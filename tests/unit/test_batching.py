"""Packing, balancing, minibatches, packed tensors, shifted logprobs and entropies.

Numerics: float64 logprobs and entropies agree with a per-row float64 reference to 1e-12;
float32 to 1e-5; bfloat16 logits (upcast inside) agree with float64 on the same bfloat16
values to 1e-5.
Planning: budgets exact; balance within the LPT bound (4/3 - 1/(3m)) of a brute-force optimum;
pack within first-fit decreasing's bound 11/9 OPT + 6/9 of a brute-force optimum.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import batching
from trainer.batching import (
    packed,
    padded,
    shift_entropy,
    shift_entropy_with_grad,
    shift_logprobs,
)
from trainer.plan import balance, minibatches, pack

TOL64 = 1e-12


def assert_partition(groups: list[list[int]], n: int) -> None:
    flat = [i for group in groups for i in group]
    assert sorted(flat) == list(range(n))


# --- pack ---------------------------------------------------------------------------------


def test_pack_by_hand():
    # decreasing: 6 (row 1), 5 (row 3), 4 (row 0), 3 (row 2), 2 (row 4); budget 10
    assert pack([4, 6, 3, 5, 2], 10) == [[0, 1], [2, 3, 4]]


def set_partitions(n: int):
    """Every way to split rows 0..n-1 into unlabelled groups (Bell(n) of them)."""
    if n == 0:
        yield []
        return
    for partition in set_partitions(n - 1):
        for g in range(len(partition)):
            yield [*partition[:g], [*partition[g], n - 1], *partition[g + 1 :]]
        yield [*partition, [n - 1]]


def brute_force_bins(lengths: list[int], budget: int) -> int:
    """Fewest micro-batches over every partition of the rows (small cases only)."""
    return min(
        len(p)
        for p in set_partitions(len(lengths))
        if all(sum(lengths[i] for i in g) <= budget for g in p)
    )


def test_pack_invariants_and_quality_on_random_cases():
    rng = random.Random(0)
    for _ in range(150):
        budget = rng.randint(8, 40)
        n = rng.randint(0, 7)
        lengths = [rng.randint(1, budget) for _ in range(n)]
        groups = pack(lengths, budget)
        assert_partition(groups, n)
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert all(0 < load <= budget for load in loads)
        assert all(g == sorted(g) for g in groups)
        # first fit: a later micro-batch's rows never fit into an earlier one's room
        assert all(
            loads[a] + loads[b] > budget for a, b in itertools.combinations(range(len(loads)), 2)
        )
        if n:
            assert len(groups) <= 11 / 9 * brute_force_bins(lengths, budget) + 6 / 9


def test_pack_is_deterministic_and_breaks_ties_by_index():
    lengths = [3, 3, 3, 3, 3]
    assert pack(lengths, 6) == [[0, 1], [2, 3], [4]]
    assert pack(lengths, 6) == pack(list(lengths), 6)


def test_pack_of_nothing_is_nothing():
    assert pack([], 10) == []


def test_a_row_over_the_budget_trains_alone():
    # 12 and 11 exceed the budget: one micro-batch each; the short rows share one
    assert pack([3, 11, 12, 2], 10) == [[2], [1], [0, 3]]


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1, 64),
    lengths=st.lists(st.integers(1, 200), max_size=24),
)
def test_pack_partitions_any_lengths_and_isolates_long_rows(budget, lengths):
    groups = pack(lengths, budget)
    assert_partition(groups, len(lengths))
    for group in groups:
        load = sum(lengths[i] for i in group)
        # a micro-batch is within the budget, or is one row longer than the budget
        assert load <= budget or (len(group) == 1 and lengths[group[0]] > budget)


@pytest.mark.parametrize(("lengths", "budget"), [([1], 0), ([0, 2], 4)])
def test_pack_refuses_bad_input(lengths, budget):
    with pytest.raises(ValueError):
        pack(lengths, budget)


# --- balance ------------------------------------------------------------------------------


def test_balance_by_hand():
    # largest first to the lightest: 7->p0, 5->p1, 4->p1 (5 < 7), 3->p0 (7 < 9), 1->p1 (9 < 10)
    assert balance([5, 7, 1, 4, 3], 2) == [[1, 4], [0, 2, 3]]


def brute_force_makespan(lengths: list[int], parts: int) -> int:
    """Smallest possible largest part over every partition into at most ``parts`` groups."""
    return min(
        max(sum(lengths[i] for i in g) for g in p)
        for p in set_partitions(len(lengths))
        if len(p) <= parts
    )


def test_balance_invariants_and_quality_on_random_cases():
    rng = random.Random(1)
    for _ in range(150):
        parts = rng.randint(1, 4)
        n = rng.randint(0, 8)
        lengths = [rng.randint(1, 50) for _ in range(n)]
        shares = balance(lengths, parts)
        assert len(shares) == parts
        assert_partition(shares, n)
        assert sum(1 for s in shares if not s) == max(0, parts - n)
        if n:
            largest = max(sum(lengths[i] for i in s) for s in shares)
            optimum = brute_force_makespan(lengths, parts)
            assert largest <= (4 / 3 - 1 / (3 * parts)) * optimum + 1e-9


def test_balance_equal_rows_spread_evenly():
    shares = balance([10] * 10, 4)
    assert sorted(len(s) for s in shares) == [2, 2, 3, 3]


def test_balance_is_deterministic():
    lengths = [random.Random(2).randint(1, 30) for _ in range(40)]
    assert balance(lengths, 3) == balance(list(lengths), 3)


def test_balance_refuses_no_parts():
    with pytest.raises(ValueError, match="parts"):
        balance([1, 2], 0)


# --- minibatches --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_rows", "count", "expected"),
    [
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (2, 5, [[0], [1]]),
        (4, 1, [[0, 1, 2, 3]]),
        (0, 2, []),
    ],
)
def test_minibatches(n_rows, count, expected):
    assert minibatches(n_rows, count) == expected


def test_minibatches_are_contiguous_and_nearly_equal():
    for n_rows in range(0, 30):
        for count in range(1, 8):
            runs = minibatches(n_rows, count)
            assert [i for run in runs for i in run] == list(range(n_rows))
            assert len(runs) == min(count, n_rows)
            sizes = [len(run) for run in runs]
            assert not sizes or max(sizes) - min(sizes) <= 1


def test_minibatches_refuse_a_zero_count():
    with pytest.raises(ValueError, match="count"):
        minibatches(4, 0)


# --- packed / padded ----------------------------------------------------------------------


def test_packed_concatenates_rows_and_fields():
    batch = packed(
        [[5, 6, 7], [8], [9, 10]],
        logprobs=[[0.0, -0.5, -1.5], [0.0], [0.0, -2.0]],
        loss_mask=[[0, 1, 1], [0], [0, 1]],
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch.sequence_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.input_ids.dtype == batch.position_ids.dtype == torch.long
    assert batch["logprobs"].tolist() == [0.0, -0.5, -1.5, 0.0, 0.0, -2.0]
    assert batch["logprobs"].dtype == torch.float32
    assert batch["loss_mask"].dtype == torch.long
    assert (batch.num_tokens, batch.num_rows, batch.lengths) == (6, 3, [3, 1, 2])


def test_packed_keeps_tensor_dtypes():
    rows = [[1, 2], [3]]
    values = [
        torch.tensor([0.5, 0.25], dtype=torch.float64),
        torch.tensor([1.0], dtype=torch.float64),
    ]
    assert packed(rows, advantages=values)["advantages"].dtype == torch.float64


def test_packed_refuses_misaligned_fields():
    with pytest.raises(ValueError, match=r"loss_mask\[1\] has shape \(1,\), expected \(2,\)"):
        packed([[1, 2], [3, 4]], loss_mask=[[0, 1], [0]])
    with pytest.raises(ValueError, match="loss_mask has 1 rows, expected 2"):
        packed([[1, 2], [3, 4]], loss_mask=[[0, 1]])


def test_packed_refuses_empty_input():
    with pytest.raises(ValueError, match="no rows"):
        packed([])
    with pytest.raises(ValueError, match="row 1 has length 0"):
        packed([[1], []])


def test_padded_right_pads_with_a_mask():
    batch = padded([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]


# --- shift_logprobs -----------------------------------------------------------------------

VOCAB = 17
ROWS = [[3, 1, 4, 1, 5], [9], [2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]


def row_reference(logits_per_row: list[torch.Tensor], rows: list[list[int]]) -> torch.Tensor:
    """Each row alone, the ordinary way: log_softmax(logits[:-1]) at the next token, 0 first."""
    out = []
    for logits, row in zip(logits_per_row, rows, strict=True):
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(row[1:])
        out.append(
            torch.cat(
                [torch.zeros(1, dtype=torch.float64), logp[:-1].gather(-1, targets[:, None])[:, 0]]
            )
        )
    return torch.cat(out)


def random_logits(rows, dtype=torch.float64, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(len(r), VOCAB, generator=g, dtype=torch.float64) * 3).to(dtype) for r in rows
    ]


def test_shift_logprobs_matches_a_per_row_reference_in_float64():
    batch = packed(ROWS)
    per_row = random_logits(ROWS)
    out = shift_logprobs(torch.cat(per_row), batch.input_ids[0], batch.cu_seqlens)
    assert out.dtype == torch.float64
    assert torch.allclose(out, row_reference(per_row, ROWS), rtol=0, atol=TOL64)
    assert out[batch.cu_seqlens[:-1].long()].tolist() == [0.0] * len(ROWS)


def test_shift_logprobs_in_float32_and_bfloat16():
    batch = packed(ROWS)
    for dtype in (torch.float32, torch.bfloat16):
        per_row = random_logits(ROWS, dtype=dtype, seed=1)
        out = shift_logprobs(torch.cat(per_row), batch.input_ids[0], batch.cu_seqlens)
        assert out.dtype == torch.float32
        assert torch.allclose(out.double(), row_reference(per_row, ROWS), rtol=0, atol=1e-5)


def test_shift_logprobs_accepts_log_softmax_values():
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS, seed=2))
    from_logits = shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)
    from_logp = shift_logprobs(torch.log_softmax(logits, -1), batch.input_ids[0], batch.cu_seqlens)
    assert torch.allclose(from_logits, from_logp, rtol=0, atol=TOL64)


def test_shift_logprobs_never_reads_across_rows():
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS, seed=3)).requires_grad_(True)
    out = shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)
    out.sum().backward()
    row_ends = (batch.cu_seqlens[1:] - 1).long()
    # the last logits of a row predict past it: no value depends on them, no gradient reaches them
    assert logits.grad[row_ends].abs().sum().item() == 0.0
    poisoned = logits.detach().clone()
    poisoned[row_ends] = float("nan")
    again = shift_logprobs(poisoned, batch.input_ids[0], batch.cu_seqlens)
    assert torch.equal(again, out.detach())


def test_shift_logprobs_gradient_matches_the_per_row_reference():
    batch = packed(ROWS)
    per_row = [t.requires_grad_(True) for t in random_logits(ROWS, seed=4)]
    weights = torch.randn(
        batch.num_tokens, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    (row_reference(per_row, ROWS) * weights).sum().backward()
    expected = torch.cat([t.grad for t in per_row])
    logits = torch.cat([t.detach() for t in per_row]).requires_grad_(True)
    (shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens) * weights).sum().backward()
    assert torch.allclose(logits.grad, expected, rtol=0, atol=TOL64)


class TinyLM(torch.nn.Module):
    """Embedding + Linear: each position's logits depend on its own token only."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(6)
        self.embed = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def test_packed_forward_of_a_tiny_model_matches_unpacked_rows():
    model = TinyLM()
    batch = packed(ROWS)
    logits = model(batch.input_ids)[0]
    out = shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)
    unpacked = [model(torch.tensor(row)[None])[0] for row in ROWS]
    assert torch.allclose(out, row_reference(unpacked, ROWS), rtol=0, atol=TOL64)


def test_shift_logprobs_refuses_mismatched_shapes():
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS))
    with pytest.raises(ValueError, match=r"logits \[T, V\]"):
        shift_logprobs(logits[None], batch.input_ids, batch.cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens"):
        shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens[:-1])


# --- shift_entropy ------------------------------------------------------------------------


def entropy_reference(logits_per_row: list[torch.Tensor]) -> list[float]:
    """Each row alone, term by term in Python floats: position 0 gets 0, position j the
    entropy -sum p log p of softmax(logits[j - 1]), with p = 0 terms left out."""
    out = []
    for logits in logits_per_row:
        out.append(0.0)
        for values in logits.double().tolist()[:-1]:
            top = max(values)
            weights = [math.exp(v - top) for v in values]
            total = sum(weights)
            out.append(-sum(w / total * math.log(w / total) for w in weights if w > 0))
    return out


def test_shift_entropy_matches_a_per_row_reference_in_float64():
    batch = packed(ROWS)
    per_row = random_logits(ROWS, seed=7)
    out = shift_entropy(torch.cat(per_row), batch.cu_seqlens)
    assert out.dtype == torch.float64
    want = torch.tensor(entropy_reference(per_row), dtype=torch.float64)
    assert torch.allclose(out, want, rtol=0, atol=TOL64)
    assert out[batch.cu_seqlens[:-1].long()].tolist() == [0.0] * len(ROWS)


def test_shift_entropy_of_uniform_and_of_certain_distributions():
    batch = packed([[1, 2, 3]])
    logits = torch.zeros(3, VOCAB, dtype=torch.float64)
    logits[1, 4] = 1e4  # position 2 is predicted with certainty
    out = shift_entropy(logits, batch.cu_seqlens)
    assert out.tolist() == pytest.approx([0.0, math.log(VOCAB), 0.0], abs=TOL64)


def test_shift_entropy_in_float32_and_bfloat16():
    batch = packed(ROWS)
    for dtype in (torch.float32, torch.bfloat16):
        per_row = random_logits(ROWS, dtype=dtype, seed=8)
        out = shift_entropy(torch.cat(per_row), batch.cu_seqlens)
        assert out.dtype == torch.float32
        want = torch.tensor(entropy_reference(per_row), dtype=torch.float64)
        assert torch.allclose(out.double(), want, rtol=0, atol=1e-5)


def test_shift_entropy_ignores_impossible_tokens():
    batch = packed(ROWS)
    per_row = random_logits(ROWS, seed=9)
    for logits in per_row:
        logits[:, :5] = float("-inf")  # as after top-k or a vocabulary mask
    out = shift_entropy(torch.cat(per_row), batch.cu_seqlens)
    want = torch.tensor(entropy_reference(per_row), dtype=torch.float64)
    assert torch.allclose(out, want, rtol=0, atol=TOL64)


def test_shift_entropy_is_the_same_in_chunks(monkeypatch):
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS, seed=10))
    whole = shift_entropy(logits, batch.cu_seqlens)
    for chunk in (1, 2, 3, batch.num_tokens - 1, batch.num_tokens):
        monkeypatch.setattr(batching, "ENTROPY_CHUNK", chunk)
        assert torch.equal(shift_entropy(logits, batch.cu_seqlens), whole), chunk


def test_shift_entropy_never_reads_across_rows_and_carries_no_gradient():
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS, seed=11)).requires_grad_(True)
    out = shift_entropy(logits, batch.cu_seqlens)
    assert not out.requires_grad
    poisoned = logits.detach().clone()
    poisoned[(batch.cu_seqlens[1:] - 1).long()] = float("nan")  # each row's last logits
    assert torch.equal(shift_entropy(poisoned, batch.cu_seqlens), out)


def test_shift_entropy_refuses_bad_shapes():
    batch = packed(ROWS)
    logits = torch.cat(random_logits(ROWS))
    with pytest.raises(ValueError, match=r"logits \[T, V\]"):
        shift_entropy(logits[None], batch.cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens"):
        shift_entropy(logits, batch.cu_seqlens[:-1])


# --- shift_entropy_with_grad (the entropy bonus) ------------------------------------------


def entropy_gradient_reference(logits_per_row: list[torch.Tensor]) -> torch.Tensor:
    """d(sum of the shifted entropies)/d logits, closed form: for the distribution p =
    softmax(z) with entropy H, dH/dz_k = -p_k (log p_k + H), and 0 where p_k = 0; a row's last
    logits predict nothing in it (0)."""
    out = []
    for logits in logits_per_row:
        grad = torch.zeros_like(logits, dtype=torch.float64)
        for j, values in enumerate(logits.double().tolist()[:-1]):
            top = max(values)
            weights = [math.exp(v - top) for v in values]
            probs = [w / sum(weights) for w in weights]
            entropy = -sum(q * math.log(q) for q in probs if q > 0)
            terms = [-q * (math.log(q) + entropy) if q > 0 else 0.0 for q in probs]
            grad[j] = torch.tensor(terms, dtype=torch.float64)
        out.append(grad)
    return torch.cat(out)


@pytest.mark.parametrize("impossible", [False, True])
def test_shift_entropy_with_grad_values_and_gradient_match_the_closed_form(impossible):
    batch = packed(ROWS)
    per_row = random_logits(ROWS, seed=12)
    if impossible:
        for logits in per_row:
            logits[:, :5] = float("-inf")  # as after top-k or a vocabulary mask
    logits = torch.cat(per_row).requires_grad_(True)
    out = shift_entropy_with_grad(logits, batch.cu_seqlens)
    want = torch.tensor(entropy_reference(per_row), dtype=torch.float64)
    assert torch.allclose(out.detach(), want, rtol=0, atol=TOL64)
    out.sum().backward()
    assert logits.grad is not None and not logits.grad.isnan().any()
    want_grad = entropy_gradient_reference(per_row)
    assert torch.allclose(logits.grad, want_grad, rtol=0, atol=TOL64)
