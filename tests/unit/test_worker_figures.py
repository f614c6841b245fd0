"""A training worker's step figures, in process: one FSDP2 worker (gloo, world size 1) on the
tiny model. The entropy it reports over the loss tokens matches a plain float64 forward of
each row to 1e-5 relative (float32 packed against float64 per row); the phase times add up.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support import start_worker
from trainer.plan import plan_step
from trainer.rollouts import Sample

TEMPERATURE = 0.7


@pytest.fixture
def worker(tiny_model_dir):
    worker = start_worker(tiny_model_dir, lr=1e-3, temperature=TEMPERATURE)
    try:
        yield worker
    finally:
        worker.shutdown()


def make_samples(count: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        ids = [rng.randrange(1, 600) for _ in range(rng.randint(6, 40))]
        prompt = rng.randint(2, len(ids) // 2)
        mask = [0] * prompt + [1] * (len(ids) - prompt)
        samples.append(
            Sample(
                session_id="s",
                input_ids=ids,
                loss_mask=mask,
                behaviour=[-rng.uniform(1, 6) if m else 0.0 for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.choice([-1.0, 1.0]) * m for m in mask],
            )
        )
    return samples


def reference_entropy_sum(model_dir, samples: list[Sample]) -> float:
    """Per row, in float64: the entropy of softmax(logits[j - 1] / T) for each loss token j."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    total = 0.0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0] / TEMPERATURE
            logp = torch.log_softmax(logits, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            total += sum(float(entropy[j - 1]) for j, m in enumerate(sample.loss_mask) if m)
    return total


def test_a_step_reports_the_entropy_of_its_loss_tokens_and_its_phase_times(worker, tiny_model_dir):
    samples = make_samples(6, seed=0)
    # one minibatch: every micro-batch is scored by the starting weights, as the reference is
    plan = plan_step(samples, 1, minibatch_count=1, max_tokens=64)
    assert len(plan.per_rank[0][0]) > 1  # several micro-batches are summed
    stats = worker.train_step(plan.per_rank[0], plan.tokens)
    assert stats["tokens"] == sum(s.loss_tokens for s in samples)
    want = reference_entropy_sum(tiny_model_dir, samples)
    assert stats["entropy_sum"] == pytest.approx(want, rel=1e-5)
    assert 0 < stats["proximal_seconds"] < stats["seconds"]
