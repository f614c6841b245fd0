"""FSDP2 workers on Ray: packed logprobs match a plain forward, and 2 workers train as 1 does."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from trainer.checkpoint import TrainerState
from trainer.cluster import LocalRay, WorkerGroup
from trainer.config import AlgorithmConfig, ClusterConfig, OptimConfig
from trainer.figures import Phases, combine, step_record
from trainer.plan import micro_batch, plan_step
from trainer.rollouts import Batch, Sample
from trainer.worker import WorkerSettings

LR = 1e-3


def settings(model_dir, **changes) -> WorkerSettings:
    return WorkerSettings(
        model_dir=str(model_dir),
        lr=LR,
        # adam eps 1e-4 keeps Adam's first step continuous in the gradient (see below)
        optim=OptimConfig(eps=1e-4, grad_clip=1.0),
        algorithm=AlgorithmConfig(temperature=1.0, off_temperature="mask", **changes),
        seed=0,
        device="cpu",
        threads=1,
    )


@pytest.fixture(scope="module")
def ray_runtime():
    with LocalRay(ClusterConfig(), num_cpus=2):
        yield


def reference_logprobs(model_dir, rows: list[list[int]]) -> list[list[float]]:
    """Each row on its own through the plain Hugging Face model, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for ids in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            logp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])
            out.append([0.0, *logp[:, 0].tolist()])
    return out


def make_samples(model_dir, count: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    rows = [[rng.randrange(1, 600) for _ in range(rng.randint(6, 70))] for _ in range(count)]
    truth = reference_logprobs(model_dir, rows)
    samples = []
    for ids, logp in zip(rows, truth, strict=True):
        prompt = rng.randint(2, len(ids) // 2)
        mask = [0] * prompt + [1] * (len(ids) - prompt)
        advantage = rng.choice([-1.0, -0.5, 0.5, 1.0])
        samples.append(
            Sample(
                session_id="s",
                input_ids=ids,
                loss_mask=mask,
                # a behaviour policy a little off the current one, as after a weight swap
                behaviour=[
                    lp + rng.gauss(0, 0.3) if m else 0.0 for lp, m in zip(logp, mask, strict=True)
                ],
                versions=[0 if m else -1 for m in mask],
                advantages=[advantage * m for m in mask],
            )
        )
    return samples


def test_packed_logprobs_through_fsdp_match_a_plain_forward(ray_runtime, tiny_model_dir):
    samples = make_samples(tiny_model_dir, 6, seed=1)
    group = WorkerGroup(1, settings(tiny_model_dir), ClusterConfig(device="cpu"))
    try:
        [per_micro] = group.call("logprobs", [micro_batch(samples[:3]), micro_batch(samples[3:])])
    finally:
        group.shutdown()
    got = per_micro[0] + per_micro[1]
    want = reference_logprobs(tiny_model_dir, [s.input_ids for s in samples])
    for g, w in zip(got, want, strict=True):
        # float32 packed forward against a float64 per-row one
        assert torch.allclose(
            torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), atol=2e-5
        )


# Figures that measure time, not the computation.
TIMINGS = {"time", "train_seconds", "proximal_seconds", "update_seconds", "tokens_per_second"}


def one_step(model_dir, world_size: int, samples: list[Sample], out_dir) -> dict:
    """One training step on ``world_size`` workers; its figures as the trainer records them."""
    group = WorkerGroup(world_size, settings(model_dir), ClusterConfig(device="cpu"))
    try:
        plan = plan_step(samples, world_size, minibatch_count=2, max_tokens=160)
        results = group.call_each("train_step", [(mb, plan.tokens) for mb in plan.per_rank])
        group.call("save_weights", str(out_dir))
    finally:
        group.shutdown()
    batch = Batch(samples=samples, session_ids=["s"], rewards=[0.5], staleness=[0] * 3)
    record = step_record(TrainerState(step=1, version=1), batch, combine(results), Phases(0, 0))
    return {key: value for key, value in record.items() if key not in TIMINGS}


def test_two_workers_train_exactly_as_one(ray_runtime, tiny_model_dir, tmp_path):
    samples = make_samples(tiny_model_dir, 12, seed=2)
    one = one_step(tiny_model_dir, 1, samples, tmp_path / "one")
    two = one_step(tiny_model_dir, 2, samples, tmp_path / "two")
    assert one["trained_tokens"] == two["trained_tokens"] == sum(s.loss_tokens for s in samples)
    assert one.keys() == two.keys()
    assert one["loss"] != 0 and one["grad_norm"] > 0
    for key, value in one.items():  # every figure, loss and grad norm included
        if isinstance(value, float):
            assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        else:
            assert two[key] == value, key
    before = load_file(tiny_model_dir / "model.safetensors")
    w1 = load_file(tmp_path / "one" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "model.safetensors")
    assert w1.keys() == w2.keys() == before.keys()
    moved = max((w1[k] - before[k]).abs().max().item() for k in before)
    assert moved > LR / 2  # the step changed the weights (Adam moves each by up to ~lr)
    for name in before:
        # Gradients differ only in float32 summation order (~1e-7 relative); with adam_eps
        # 1e-4 that moves an update by at most ~lr * 1e-3 over two optimizer steps.
        assert torch.allclose(w1[name], w2[name], rtol=0, atol=LR * 1e-3), name
