"""Decoupled PPO loss against a per-token float64 Python reference.

Tolerances: float64 loss and gradients agree with the reference to 1e-12 (relative to 1);
gradcheck runs with its float64 defaults (eps 1e-6, atol 1e-5, rtol 1e-3); float32 inputs
agree with the float64 reference to 1e-5. Masked tokens with absurd values (huge, infinite or
NaN log-ratios) leave the loss and its gradient finite and unchanged (exactly).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import AlgorithmConfig, ConfigError
from trainer.loss import decoupled_ppo_loss
from trainer.objectives import STAT_NAMES, LossInputs, policy_loss
from trainer.objectives.kl import k3_kl

TOL = 1e-12
ARGUMENTS = ("sequence_ids", "reference_logprobs", "total_tokens")


def ppo_loss(logprobs, proximal, behaviour, advantages, mask, **options):
    """`policy_loss` of the "ppo" entry with the algorithm's options given as keywords (no cap
    unless asked: the reference's default), as the trainer passes its frozen AlgorithmConfig.
    Without sequence_ids every token is a row of its own."""
    arguments = {k: options.pop(k) for k in ARGUMENTS if k in options}
    algorithm = AlgorithmConfig(**{"behaviour_cap": None, **options})
    sequence_ids = arguments.get("sequence_ids")
    if sequence_ids is None:
        sequence_ids = torch.arange(logprobs.shape[-1])
    inputs = LossInputs(
        logprobs=logprobs,
        proximal=proximal,
        behaviour=behaviour,
        advantages=advantages,
        loss_mask=mask,
        sequence_ids=sequence_ids,
        entropy=None,
        reference=arguments.get("reference_logprobs"),
        total_tokens=arguments["total_tokens"],
        total_sequences=1.0,  # token_mean does not use it
    )
    return policy_loss(inputs, algorithm)


@dataclass
class Case:
    logprobs: torch.Tensor
    proximal: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    sequence_ids: torch.Tensor
    reference: torch.Tensor


def random_case(seed: int, n: int = 64, spread: float = 1.5, dtype=torch.float64) -> Case:
    g = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(n, generator=g, dtype=torch.float64) * (high - low) + low

    proximal = uniform(-4.0, -0.05)
    lengths = torch.randint(1, 12, (n,), generator=g)
    sequence_ids = torch.repeat_interleave(torch.arange(n), lengths)[:n]
    return Case(
        logprobs=(proximal + uniform(-spread, spread)).to(dtype),
        proximal=proximal.to(dtype),
        behaviour=(proximal + uniform(-1.0, 1.0)).to(dtype),
        advantages=uniform(-2.0, 2.0).to(dtype),
        mask=(torch.rand(n, generator=g) < 0.8).to(dtype),
        sequence_ids=sequence_ids,
        reference=(proximal + uniform(-0.5, 0.5)).to(dtype),
    )


def reference_loss(  # noqa: PLR0915  # the loss spelt out, token by token
    case: Case, total_tokens: float, **options
) -> tuple[float, list[float], dict]:
    """Loss, d loss / d logprobs, and stats, one token at a time in Python floats."""
    eps_low = options.get("eps_clip", 0.2)
    eps_high = options.get("eps_clip_high") or eps_low
    cap = options.get("behaviour_cap")
    mode = options.get("behaviour_mode", "token_mask")
    dual = options.get("dual_clip")
    kl_coef = options.get("kl_coef", 0.0)
    use_reference = options.get("reference_logprobs") is not None
    lp, prox, behav = case.logprobs.tolist(), case.proximal.tolist(), case.behaviour.tolist()
    adv, mask, seq = case.advantages.tolist(), case.mask.tolist(), case.sequence_ids.tolist()
    ref = case.reference.tolist()
    n = len(lp)

    raw = [math.exp(prox[i] - behav[i]) for i in range(n)]
    over = [cap is not None and mask[i] > 0 and raw[i] > cap for i in range(n)]
    keep = [mask[i] > 0 for i in range(n)]
    weight = list(raw)
    if cap is not None and mode == "truncate":
        weight = [min(w, cap) for w in raw]
    elif cap is not None and mode == "token_mask":
        keep = [keep[i] and not over[i] for i in range(n)]
    elif cap is not None and mode == "sequence_mask":
        bad = {seq[i] for i in range(n) if over[i]}
        keep = [keep[i] and seq[i] not in bad for i in range(n)]

    total, grad = 0.0, [0.0] * n
    stats = dict.fromkeys(STAT_NAMES, 0.0)  # clipped_sequences etc.: 0 under ppo, no entropy
    for i in range(n):
        r = math.exp(lp[i] - prox[i])
        a = adv[i]
        unclipped = -a * r
        clipped = -a * min(max(r, 1 - eps_low), 1 + eps_high)
        pg, d_pg = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * r)
        dual_active = dual is not None and a < 0 and pg > -a * dual
        if dual_active:
            pg, d_pg = -a * dual, 0.0
        kl = math.exp(ref[i] - lp[i]) - (ref[i] - lp[i]) - 1 if use_reference else 0.0
        d_kl = 1 - math.exp(ref[i] - lp[i]) if use_reference else 0.0
        if mask[i] > 0:
            stats["tokens"] += 1
            stats["behaviour_weight_sum"] += raw[i]
            stats["behaviour_over_cap_tokens"] += over[i]
        if not keep[i]:
            stats["behaviour_masked_tokens"] += mask[i] > 0
            continue
        total += weight[i] * pg + kl_coef * kl
        grad[i] = (weight[i] * d_pg + kl_coef * d_kl) / total_tokens
        stats["kept_tokens"] += 1
        stats["clipped_tokens"] += clipped > unclipped
        stats["dual_clipped_tokens"] += dual_active
        stats["ratio_sum"] += r
        stats["approx_kl_sum"] += math.exp(prox[i] - lp[i]) - (prox[i] - lp[i]) - 1
        stats["reference_kl_sum"] += kl
        stats["pg_loss_sum"] += weight[i] * pg
    return total / total_tokens, grad, stats


def run(case: Case, total_tokens: float, **options):
    if options.get("kl_coef"):  # a KL term needs the reference's logprobs
        options.setdefault("reference_logprobs", case.reference)
    logprobs = case.logprobs.clone().requires_grad_(True)
    loss, stats = ppo_loss(
        logprobs,
        case.proximal,
        case.behaviour,
        case.advantages,
        case.mask,
        total_tokens=total_tokens,
        sequence_ids=case.sequence_ids,
        **options,
    )
    loss.backward()
    return loss, logprobs.grad, stats


def assert_matches_reference(case: Case, total_tokens: float, tol: float = TOL, **options):
    loss, grad, stats = run(case, total_tokens, **options)
    expected_loss, expected_grad, expected_stats = reference_loss(case, total_tokens, **options)
    assert abs(loss.item() - expected_loss) <= tol * max(1.0, abs(expected_loss))
    assert torch.allclose(
        grad.double(), torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=tol
    )
    assert set(stats) == set(STAT_NAMES)
    for name, value in stats.items():
        assert not value.requires_grad
        assert abs(value.item() - expected_stats[name]) <= tol * max(1.0, abs(expected_stats[name]))
    return stats


OPTIONS = [
    {},
    {"eps_clip": 0.1, "eps_clip_high": 0.28},
    {"dual_clip": 3.0},
    {"behaviour_cap": 1.5, "behaviour_mode": "truncate"},
    {"behaviour_cap": 1.5, "behaviour_mode": "token_mask"},
    {"behaviour_cap": 1.5, "behaviour_mode": "sequence_mask"},
    {"behaviour_cap": 2.0, "behaviour_mode": "token_mask", "dual_clip": 2.0, "kl_coef": 0.1},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(map(str, o.values())) or "plain"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_gradient_and_stats_match_the_reference(options, seed):
    case = random_case(seed)
    if options.get("kl_coef"):
        options = {**options, "reference_logprobs": case.reference}
    stats = assert_matches_reference(case, total_tokens=100.0, **options)
    # the random case reaches every region the options switch on
    assert stats["clipped_tokens"] > 0
    assert (stats["dual_clipped_tokens"] > 0) == ("dual_clip" in options)
    assert (stats["behaviour_over_cap_tokens"] > 0) == ("behaviour_cap" in options)


def test_kl_to_the_reference_matches_the_reference():
    case = random_case(3)
    stats = assert_matches_reference(
        case, total_tokens=50.0, kl_coef=0.3, reference_logprobs=case.reference
    )
    assert stats["reference_kl_sum"] > 0


def test_kl_is_reported_but_not_trained_at_zero_coefficient():
    case = random_case(4)
    loss_without, grad_without, _ = run(case, 64.0)
    loss_with, grad_with, stats = run(case, 64.0, kl_coef=0.0, reference_logprobs=case.reference)
    assert loss_with.item() == loss_without.item()
    assert torch.equal(grad_with, grad_without)
    expected = k3_kl(case.logprobs, case.reference)[case.mask.bool()].sum().item()
    assert abs(stats["reference_kl_sum"].item() - expected) <= TOL * max(1.0, expected)


def test_k3_is_zero_on_equal_policies_and_positive_otherwise():
    p = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    assert torch.equal(k3_kl(p, p), torch.zeros(3, dtype=torch.float64))
    assert (k3_kl(p, p + torch.tensor([0.3, -0.3, 1.0], dtype=torch.float64)) > 0).all()


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(map(str, o.values())) or "plain"
)
def test_gradcheck(options):
    case = random_case(5, n=24)
    options = {**options, "reference_logprobs": case.reference}

    def loss_of(logprobs: torch.Tensor) -> torch.Tensor:
        return ppo_loss(
            logprobs,
            case.proximal,
            case.behaviour,
            case.advantages,
            case.mask,
            total_tokens=24,
            sequence_ids=case.sequence_ids,
            **options,
        )[0]

    assert torch.autograd.gradcheck(loss_of, (case.logprobs.clone().requires_grad_(True),))


# --- clipping regions, token by token -----------------------------------------------------


def one_token_case(log_ratio: float, advantage: float) -> Case:
    prox = torch.tensor([-1.0], dtype=torch.float64)
    return Case(
        logprobs=prox + log_ratio,
        proximal=prox,
        behaviour=prox.clone(),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        mask=torch.ones(1, dtype=torch.float64),
        sequence_ids=torch.zeros(1, dtype=torch.long),
        reference=prox.clone(),
    )


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "clipped"),
    [
        (1.5, 1.0, -1.2, True),  # A > 0, above 1 + eps: flat at the clip, no gradient
        (0.5, 1.0, -0.5, False),  # A > 0, below 1 - eps: the unclipped term is the max
        (0.5, -1.0, 0.8, True),  # A < 0, below 1 - eps: flat at the clip
        (1.5, -1.0, 1.5, False),  # A < 0, above 1 + eps: unclipped, keeps pushing down
        (1.1, 2.0, -2.2, False),  # inside the trust region
        (1.1, 0.0, 0.0, False),  # no advantage, no loss
    ],
)
def test_clipping_regions(ratio, advantage, expected_loss, clipped):
    case = one_token_case(math.log(ratio), advantage)
    loss, grad, stats = run(case, 1.0)
    assert abs(loss.item() - expected_loss) <= TOL
    assert stats["clipped_tokens"].item() == int(clipped)
    expected_grad = 0.0 if clipped else -advantage * ratio
    assert abs(grad.item() - expected_grad) <= TOL


def test_asymmetric_clip_uses_the_high_bound_above_one():
    loss, grad, _ = run(one_token_case(math.log(1.5), 1.0), 1.0, eps_clip_high=0.28)
    assert abs(loss.item() + 1.28) <= TOL and grad.item() == 0.0
    loss, _, _ = run(one_token_case(math.log(0.5), -1.0), 1.0, eps_clip_high=0.28)
    assert abs(loss.item() - 0.8) <= TOL  # the low side still clips at 1 - eps_clip


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # A < 0, ratio 5: plain PPO loss 5 |A|; dual clip c = 3 caps it at 3 |A| with no gradient
    loss, grad, stats = run(one_token_case(math.log(5.0), -2.0), 1.0, dual_clip=3.0)
    assert abs(loss.item() - 6.0) <= TOL
    assert grad.item() == 0.0
    assert stats["dual_clipped_tokens"].item() == 1
    # below the dual bound nothing changes
    loss, grad, stats = run(one_token_case(math.log(2.0), -2.0), 1.0, dual_clip=3.0)
    assert abs(loss.item() - 4.0) <= TOL and abs(grad.item() - 4.0) <= TOL
    assert stats["dual_clipped_tokens"].item() == 0
    # positive advantages are never dual-clipped
    loss, _, stats = run(one_token_case(math.log(5.0), 2.0), 1.0, dual_clip=3.0)
    assert abs(loss.item() + 2.4) <= TOL and stats["dual_clipped_tokens"].item() == 0


# --- behaviour weight ---------------------------------------------------------------------


def behaviour_case() -> Case:
    """Two sequences; token 1 (sequence 0) has weight e^1 > 2, token 4 (sequence 1) e^-1."""
    prox = torch.full((6,), -1.0, dtype=torch.float64)
    behaviour = prox - torch.tensor([0.0, 1.0, 0.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    return Case(
        logprobs=prox.clone(),
        proximal=prox,
        behaviour=behaviour,
        advantages=torch.ones(6, dtype=torch.float64),
        mask=torch.tensor([0.0, 1, 1, 0, 1, 1], dtype=torch.float64),
        sequence_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        reference=prox.clone(),
    )


def test_behaviour_weight_multiplies_the_policy_loss_when_uncapped():
    loss, grad, stats = run(behaviour_case(), 4.0)
    e = math.e
    assert abs(loss.item() - -(e + 1 + 1 / e + 1) / 4) <= TOL
    assert torch.allclose(
        grad, torch.tensor([0, -e, -1, 0, -1 / e, -1], dtype=torch.float64) / 4, rtol=0, atol=TOL
    )
    assert stats["behaviour_masked_tokens"].item() == 0


def test_truncate_caps_the_weight():
    loss, _, stats = run(behaviour_case(), 4.0, behaviour_cap=2.0, behaviour_mode="truncate")
    assert abs(loss.item() - -(2 + 1 + 1 / math.e + 1) / 4) <= TOL
    assert stats["behaviour_over_cap_tokens"].item() == 1
    assert stats["behaviour_masked_tokens"].item() == 0


def test_token_mask_drops_only_the_token_over_the_cap():
    loss, grad, stats = run(behaviour_case(), 4.0, behaviour_cap=2.0, behaviour_mode="token_mask")
    assert abs(loss.item() - -(1 + 1 / math.e + 1) / 4) <= TOL
    assert grad[1].item() == 0.0
    assert stats["kept_tokens"].item() == 3 and stats["behaviour_masked_tokens"].item() == 1


def test_sequence_mask_drops_the_whole_sequence():
    loss, grad, stats = run(
        behaviour_case(), 4.0, behaviour_cap=2.0, behaviour_mode="sequence_mask"
    )
    assert abs(loss.item() - -(1 / math.e + 1) / 4) <= TOL
    assert grad[:3].abs().sum().item() == 0.0
    assert stats["kept_tokens"].item() == 2 and stats["behaviour_masked_tokens"].item() == 2
    assert stats["tokens"].item() == 4


def test_a_prompt_token_over_the_cap_masks_nothing():
    case = behaviour_case()
    case.behaviour[0] = case.proximal[0] - 5.0  # weight e^5, but token 0 is not a loss token
    _, _, stats = run(case, 4.0, behaviour_cap=2.0, behaviour_mode="sequence_mask")
    assert stats["behaviour_over_cap_tokens"].item() == 1  # token 1 only
    assert stats["kept_tokens"].item() == 2


def test_the_old_entry_point_is_the_ppo_entry_and_sequence_mask_needs_sequence_ids():
    """trainer/loss.py, kept for callers that predate the table, gives the table's result."""
    case = behaviour_case()
    algorithm = AlgorithmConfig(behaviour_cap=2.0, behaviour_mode="sequence_mask")
    arguments = (case.logprobs, case.proximal, case.behaviour, case.advantages, case.mask)
    with pytest.raises(ValueError, match="sequence_ids"):
        decoupled_ppo_loss(*arguments, total_tokens=4, algorithm=algorithm)
    old, _ = decoupled_ppo_loss(
        *arguments, total_tokens=4, algorithm=algorithm, sequence_ids=case.sequence_ids
    )
    new, _, _ = run(case, 4.0, behaviour_cap=2.0, behaviour_mode="sequence_mask")
    assert old.item() == new.item()


def test_no_gradient_reaches_proximal_behaviour_or_advantages():
    case = random_case(6)
    inputs = [t.clone().requires_grad_(True) for t in (case.proximal, case.behaviour)]
    advantages = case.advantages.clone().requires_grad_(True)
    logprobs = case.logprobs.clone().requires_grad_(True)
    loss, _ = ppo_loss(logprobs, *inputs, advantages, case.mask, total_tokens=10, behaviour_cap=1.5)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    assert all(t.grad is None for t in [*inputs, advantages])


# --- aggregation and plain PPO --------------------------------------------------------------


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(map(str, o.values())) or "plain"
)
def test_micro_batch_losses_sum_to_the_whole_batch_loss(options):
    case = random_case(7, n=90)
    total = case.mask.sum().item()
    whole_loss, whole_grad, whole_stats = run(case, total, **options)
    # split on sequence boundaries, as packing does: micro-batches never cut a row
    cuts = [0, *[i for i in range(1, 90) if case.sequence_ids[i] != case.sequence_ids[i - 1]]]
    bounds = [cuts[0], cuts[len(cuts) // 3], cuts[2 * len(cuts) // 3], 90]
    loss_sum, grads, stat_sums = 0.0, [], dict.fromkeys(STAT_NAMES, 0.0)
    for start, end in itertools.pairwise(bounds):
        part = Case(*(getattr(case, f)[start:end] for f in Case.__dataclass_fields__))
        loss, grad, stats = run(part, total, **options)
        loss_sum += loss.item()
        grads.append(grad)
        for name, value in stats.items():
            stat_sums[name] += value.item()
    assert abs(loss_sum - whole_loss.item()) <= TOL
    assert torch.allclose(torch.cat(grads), whole_grad, rtol=0, atol=TOL)
    for name, value in whole_stats.items():
        assert abs(stat_sums[name] - value.item()) <= TOL * max(1.0, abs(value.item()))


def test_loss_is_the_token_mean_of_the_step():
    case = random_case(8)
    tokens = case.mask.sum().item()
    loss, _, stats = run(case, tokens)
    assert abs(loss.item() - stats["pg_loss_sum"].item() / stats["tokens"].item()) <= TOL


def standard_ppo_loss(logprobs, old_logprobs, advantages, mask, eps):
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps, 1 + eps) * advantages)
    return -(surrogate * mask).sum() / mask.sum()


@pytest.mark.parametrize("cap", [None, 1.5, 2.0])
@pytest.mark.parametrize("mode", ["truncate", "token_mask", "sequence_mask"])
@pytest.mark.parametrize("proximal", ["none", "behaviour"])
def test_plain_ppo_is_proximal_equal_to_behaviour(cap, mode, proximal):
    case = random_case(9)
    logprobs = case.logprobs.clone().requires_grad_(True)
    loss, stats = ppo_loss(
        logprobs,
        None if proximal == "none" else case.behaviour,
        case.behaviour,
        case.advantages,
        case.mask,
        total_tokens=case.mask.sum().item(),
        decoupled=False,
        behaviour_cap=cap,
        behaviour_mode=mode,
        sequence_ids=case.sequence_ids,
    )
    loss.backward()
    expected_logprobs = case.logprobs.clone().requires_grad_(True)
    expected = standard_ppo_loss(expected_logprobs, case.behaviour, case.advantages, case.mask, 0.2)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= TOL
    assert torch.allclose(logprobs.grad, expected_logprobs.grad, rtol=0, atol=TOL)
    assert stats["behaviour_weight_sum"].item() == stats["tokens"].item()  # w == 1 exactly
    assert stats["behaviour_masked_tokens"].item() == 0


def test_decoupled_ppo_needs_the_proximal_logprobs():
    case = random_case(9, n=4)
    with pytest.raises(ValueError, match="proximal"):
        ppo_loss(case.logprobs, None, case.behaviour, case.advantages, case.mask, total_tokens=4)


def test_float32_inputs_agree_with_the_float64_reference():
    case64 = random_case(10)
    case32 = Case(
        *(
            t.float() if t.is_floating_point() else t
            for t in (getattr(case64, f) for f in Case.__dataclass_fields__)
        )
    )
    options = {"behaviour_cap": 1.5, "behaviour_mode": "truncate", "dual_clip": 3.0}
    loss, grad, _ = run(case32, 64.0, **options)
    assert loss.dtype == torch.float32
    expected_loss, expected_grad, _ = reference_loss(case64, 64.0, **options)
    assert abs(loss.item() - expected_loss) <= 1e-5
    assert torch.allclose(
        grad.double(), torch.tensor(expected_grad, dtype=torch.float64), rtol=0, atol=1e-5
    )


def test_boolean_loss_mask_is_accepted():
    case = random_case(11)
    loss_float, _, _ = run(case, 64.0)
    case.mask = case.mask.bool()
    loss_bool, _, _ = run(case, 64.0)
    assert loss_bool.item() == loss_float.item()


def test_an_all_masked_micro_batch_has_zero_loss_and_gradient():
    case = random_case(12)
    case.mask = torch.zeros_like(case.mask)
    loss, grad, stats = run(case, 10.0, behaviour_cap=1.5, behaviour_mode="sequence_mask")
    assert loss.item() == 0.0 and grad.abs().sum().item() == 0.0
    assert stats["tokens"].item() == 0


# --- masked tokens are inert ----------------------------------------------------------------


ABSURD = [1e4, -1e4, math.inf, -math.inf, math.nan]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    option=st.sampled_from(range(len(OPTIONS))),
    where=st.sampled_from(["logprobs", "proximal", "behaviour", "reference"]),
    value=st.sampled_from(ABSURD),
)
def test_masked_tokens_with_absurd_values_change_nothing(seed, option, where, value):
    """A masked token (a prompt position, a stale or off-temperature token) may carry any
    logprob: the loss and the gradient stay finite, and equal to the loss without it."""
    case = random_case(seed, n=32)
    options = {**OPTIONS[option], "kl_coef": 0.1, "reference_logprobs": case.reference}
    clean_loss, clean_grad, _ = run(case, 32.0, **options)
    masked = torch.nonzero(case.mask == 0).flatten()
    if masked.numel() == 0:
        return
    getattr(case, where)[masked] = value
    if where == "reference":
        options["reference_logprobs"] = case.reference
    loss, grad, stats = run(case, 32.0, **options)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == clean_loss.item()
    assert torch.equal(grad[case.mask.bool()], clean_grad[case.mask.bool()])
    assert (grad[masked] == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask", "truncate", None])
@pytest.mark.parametrize("behaviour", [-100.0, -1e4, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_loss_token_with_an_absurd_behaviour_logprob_sends_no_nan_back(mode, behaviour, dtype):
    """A loss token whose pi_prox / pi_behav overflows: removed by the behaviour mask (weight
    0, not inf * 0), truncated to the cap, or, without a cap, weighted e^MAX_LOG_RATIO: the
    loss and every gradient stay finite."""
    case = random_case(15, n=16, dtype=dtype)
    case.mask[:] = 1
    case.behaviour[3] = behaviour
    options = {"behaviour_cap": 2.0, "behaviour_mode": mode} if mode else {}
    loss, grad, stats = run(case, 16.0, **options)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    if mode in ("token_mask", "sequence_mask"):
        assert grad[3] == 0 and stats["behaviour_masked_tokens"] >= 1


# --- refused inputs -----------------------------------------------------------------------


def test_an_empty_step_is_refused():
    case = random_case(13, n=4)
    with pytest.raises(ValueError, match="total_tokens"):
        ppo_loss(
            case.logprobs, case.proximal, case.behaviour, case.advantages, case.mask, total_tokens=0
        )


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"eps_clip": 0.0}, "algorithm.eps_clip"),
        ({"eps_clip": 1.0}, "algorithm.eps_clip"),
        ({"eps_clip_high": -0.1}, "algorithm.eps_clip_high"),
        ({"behaviour_cap": 1.0}, "algorithm.behaviour_cap"),
        ({"behaviour_mode": "clip"}, "algorithm.behaviour_mode"),
        ({"dual_clip": 1.0}, "algorithm.dual_clip"),
        ({"kl_coef": -0.1}, "algorithm.kl_coef"),
    ],
)
def test_every_bound_of_the_loss_is_refused_when_the_algorithm_is_made(options, field):
    """One check, at start: the loss itself checks none of these again."""
    with pytest.raises(ConfigError) as caught:
        AlgorithmConfig(**options)
    assert caught.value.field_name == field


def test_mismatched_shapes_are_refused():
    case = random_case(14, n=4)
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(
            case.logprobs,
            case.proximal,
            case.behaviour,
            case.advantages[:3],
            case.mask,
            total_tokens=4,
        )
    with pytest.raises(ValueError, match="1-D"):
        ppo_loss(
            case.logprobs[None],
            case.proximal[None],
            case.behaviour[None],
            case.advantages[None],
            case.mask[None],
            total_tokens=4,
        )
