"""trainer/algorithm.py's training step on any backend, held to a hand-written float64 step.

`PlainBackend` implements trainer/backend.py's `Backend` on one unsharded model (the trainer's
packed attention, plain autograd, any optimizer): no FSDP, no torch.distributed. On it, in
float64, one `train_step` of two PPO minibatches (plain SGD, so an update is -lr times the
gradient) must give the weights of a step written here from the paper's definition, each row
forwarded alone with transformers' own attention:

    decoupled PPO, AReaL (arXiv 2505.24298) §5, its decoupled objective: per loss token t,
        J_t = pi_prox / pi_behav * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t),
        r_t = pi_theta / pi_prox, pi_prox the policy at the start of the step (no gradient);
    plain PPO, Schulman et al. 2017 (arXiv 1707.06347) Eq. 7: the same with pi_prox = pi_behav;
    the loss of a minibatch is -(1/N) sum_t J_t over its N loss tokens, minus
    entropy_coef * (1/N) sum_t H_t for the entropy bonus (Eq. 9's c2 S term).

Tolerance: the updated weights agree to 1e-10 of the largest weight change, and the grad norms
to 1e-10 relative (float64 both sides; measured 6.7e-16 to 1.0e-15 of a change of 0.15-0.33,
norms within 1.7e-15). The behaviour cap case masks the tokens whose pi_prox / pi_behav exceeds
the cap (AReaL's token mask; they still count in N). Caught: a total_tokens off by one (all
cases fail), the proximal logprobs recomputed before each minibatch (every decoupled case).

The FSDP2 worker (world size 1, gloo) and `PlainBackend` on the same float32 model, data and
AdamW give the same step: the same weights to 1e-6 of the largest change and the same figures
(measured: equal to the bit).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support import free_port
from trainer.algorithm import train_step
from trainer.backend import EntropyMode, Forward
from trainer.batching import packed, shift_entropy, shift_entropy_with_grad, shift_logprobs
from trainer.config import AlgorithmConfig, OptimConfig
from trainer.model import load_model
from trainer.plan import MicroBatch, minibatches, plan_step
from trainer.rollouts import Sample
from trainer.worker import Worker, WorkerSettings

TEMPERATURE = 0.7
LR = 0.5  # SGD on the tiny model: the second minibatch's ratios leave the clip range
TOLERANCE = 1e-10  # of the largest weight change, float64 against float64
FSDP_TOLERANCE = 1e-6  # of the largest weight change, float32 FSDP2 against float32 plain


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as a worker runs (threads=1): tiny matrices gain nothing from more,
    and on a busy machine the thread pool's contention costs 30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PlainBackend:
    """`trainer.backend.Backend` on one unsharded module: what a single-device backend needs."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float = 0.0
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.grad_clip = grad_clip

    def forward(
        self, micro: MicroBatch, *, grad: bool = False, entropy: EntropyMode = "none"
    ) -> Forward:
        batch = packed(micro.rows or [[0]])
        with torch.set_grad_enabled(grad):
            logits = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                cu_seq_lens_q=batch.cu_seqlens,
                use_cache=False,
            ).logits[0]
            logits = logits / TEMPERATURE
            entropies = {
                "none": lambda: None,
                "detached": lambda: shift_entropy(logits.detach(), batch.cu_seqlens),
                "grad": lambda: shift_entropy_with_grad(logits, batch.cu_seqlens),
            }[entropy]()
            logprobs = shift_logprobs(logits, batch.input_ids[0], batch.cu_seqlens)
        return Forward(logprobs, entropies, batch.sequence_ids)

    def reference(self, micro: MicroBatch) -> torch.Tensor | None:
        return None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit))
        self.optimizer.step()
        return norm

    def synchronize(self) -> None:
        pass


def make_samples(start_logprobs, rows: list[list[int]], seed: int) -> list[Sample]:
    """Rows with a prompt, loss tokens, advantages of both signs and sizes, and behaviour
    logprobs off the starting policy's by up to 0.7 nats either way (so pi_prox / pi_behav
    ranges over about [0.5, 2])."""
    rng = random.Random(seed)
    samples = []
    for ids in rows:
        prompt = rng.randint(2, len(ids) // 2)
        mask = [0] * prompt + [1] * (len(ids) - prompt)
        start = start_logprobs(ids)
        samples.append(
            Sample(
                session_id="s",
                input_ids=ids,
                loss_mask=mask,
                behaviour=[
                    start[j] + rng.uniform(-0.7, 0.7) if m else 0.0 for j, m in enumerate(mask)
                ],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.uniform(-2, 2) * m for m in mask],
                fresh=list(mask),
            )
        )
    return samples


def random_rows(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 680) for _ in range(rng.randint(8, 30))] for _ in range(count)]


def row_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token 1..L-1 of one row alone: log pi(token | earlier) and the entropy of the
    distribution that predicted it, at TEMPERATURE (transformers' own attention)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1] / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


def reference_step(
    model, samples: list[Sample], minibatch_count: int, algorithm: AlgorithmConfig
) -> list[float]:
    """The step by hand (module docstring): SGD at LR, one update per minibatch; its grad
    norms. Updates ``model`` in place."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        proximal = [row_logprobs(model, s.input_ids)[0] for s in samples]
    eps, cap = algorithm.eps_clip, algorithm.behaviour_cap
    norms = []
    for indices in minibatches(len(samples), minibatch_count):
        count = sum(samples[i].loss_tokens for i in indices)
        objective = torch.zeros((), dtype=torch.float64)
        for i in indices:
            sample = samples[i]
            logprobs, entropy = row_logprobs(model, sample.input_ids)
            mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            behaviour = torch.tensor(sample.behaviour[1:], dtype=torch.float64)
            advantage = torch.tensor(sample.advantages[1:], dtype=torch.float64)
            prox = proximal[i] if algorithm.decoupled else behaviour
            ratio = torch.exp(logprobs - prox)
            weight = torch.exp(prox - behaviour)
            kept = mask if cap is None else mask & (weight <= cap)
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)
            objective = objective + (weight * surrogate)[kept].sum()
            objective = objective + algorithm.entropy_coef * entropy[mask].sum()
        loss = -objective / count
        grads = torch.autograd.grad(loss, params)
        norms.append(float(torch.stack([(g * g).sum() for g in grads]).sum().sqrt()))
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= LR * g
    return norms


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def largest_gap(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


ALGORITHMS = {
    "decoupled": AlgorithmConfig(temperature=TEMPERATURE, behaviour_cap=None),
    "decoupled_capped": AlgorithmConfig(temperature=TEMPERATURE, behaviour_cap=1.3),
    "plain_ppo": AlgorithmConfig(temperature=TEMPERATURE, decoupled=False),
    "entropy_bonus": AlgorithmConfig(
        temperature=TEMPERATURE, behaviour_cap=None, entropy_coef=0.05
    ),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_step_on_a_plain_backend_is_the_papers_step_in_float64(tiny_model_dir, name, seed):
    algorithm = ALGORITHMS[name]
    model = load_model(tiny_model_dir).double()  # the trainer's packed attention
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        samples = make_samples(
            lambda ids: [0.0, *row_logprobs(reference, ids)[0].tolist()], random_rows(seed), seed
        )
    before = weights(model)

    plan = plan_step(samples, 1, minibatch_count=2, max_tokens=24)
    assert len(plan.per_rank[0][0]) > 1  # a minibatch of several micro-batches
    backend = PlainBackend(model, torch.optim.SGD(model.parameters(), lr=LR))
    stats = train_step(backend, plan.per_rank[0], plan.tokens, plan.sequences, algorithm, lr=LR)
    want_norms = reference_step(reference, samples, 2, algorithm)

    change = largest_gap(weights(reference), before)
    assert change > 1e-3  # the step moved the weights
    assert largest_gap(weights(model), weights(reference)) <= TOLERANCE * change
    assert stats["grad_norms"] == pytest.approx(want_norms, rel=TOLERANCE)
    assert stats["tokens"] == sum(s.loss_tokens for s in samples)
    assert stats["clipped_tokens"] > 0  # the clip took part
    if algorithm.decoupled and algorithm.behaviour_cap is not None:
        assert 0 < stats["behaviour_masked_tokens"] < stats["tokens"]


@pytest.mark.parametrize("counted_by_workers", [False, True])
def test_the_fsdp_worker_and_the_plain_backend_make_the_same_step(
    tiny_model_dir, counted_by_workers
):
    """Also with the rows holding loss tokens left for the workers to count (a sequence mean
    divides by them): the same step as with the plan's count."""
    optim = OptimConfig(grad_clip=1.0)
    algorithm = replace(ALGORITHMS["decoupled_capped"], entropy_coef=0.01)
    if counted_by_workers:
        algorithm = replace(algorithm, aggregation="sequence_mean")
    settings = WorkerSettings(
        model_dir=str(tiny_model_dir), lr=1e-3, optim=optim, algorithm=algorithm,
        seed=0, device="cpu", threads=1,
    )  # fmt: skip
    worker = Worker(0, 1, settings)
    worker.setup("127.0.0.1", free_port())
    try:
        model = load_model(tiny_model_dir)
        scorer = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            samples = make_samples(
                lambda ids: [0.0, *row_logprobs(scorer, ids)[0].tolist()], random_rows(3, 8), 3
            )
        plan = plan_step(samples, 1, minibatch_count=3, max_tokens=64)
        before = weights(model)
        adamw = torch.optim.AdamW(
            model.parameters(), lr=1e-3, betas=(optim.beta1, optim.beta2), eps=optim.eps,
            weight_decay=optim.weight_decay,
        )  # fmt: skip
        backend = PlainBackend(model, adamw, grad_clip=optim.grad_clip)
        plain = train_step(
            backend, plan.per_rank[0], plan.tokens, plan.sequences, algorithm, lr=1e-3
        )
        sequences = None if counted_by_workers else plan.sequences
        sharded = worker.train_step(plan.per_rank[0], plan.tokens, sequences, algorithm)
        state = worker.full_state()
    finally:
        worker.shutdown()
    trained = weights(model)
    fsdp = {name: state[name] for name in trained}
    change = largest_gap(trained, before)
    assert change > 1e-4
    assert largest_gap(fsdp, trained) <= FSDP_TOLERANCE * change
    timings = {"seconds", "proximal_seconds"}
    for key in plain.keys() - timings:
        assert sharded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
