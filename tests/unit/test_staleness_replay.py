"""The forced-staleness replay (``bench/staleness_replay.py``) samples what it says it samples.

Step t of a run with staleness eta must train on a batch sampled by the weights after
``max(0, t - eta)`` steps (its ring of snapshots), with those weights' logprobs of the sampled
tokens as the behaviour logprobs. Checked against the test's own copies of the worker's weights,
taken before each step, and a float64 forward of them (plain Hugging Face, no packing): the
behaviour logprobs are within ``TOLERANCE`` = 1e-4 nats of the right version (float32 packed
against float64: measured max 1.2e-6) and more than ``APART`` = 1e-2 from every other version
(the test's learning rate moves the untrained tiny model's logprobs by 0.1 or more per step),
so a ring that hands out the wrong snapshot, or snapshots that alias the live weights, fails.

At eta 0 the replay is on-policy: the behaviour logprobs equal the worker's own logprobs at the
start of the step (the proximal policy decoupled PPO recomputes) to ``ON_POLICY`` = 1e-6.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bench import staleness_replay as replay
from trainer.plan import plan_step

TOLERANCE = 1e-4
APART = 1e-2
ON_POLICY = 1e-6
STEPS = 5


def config(eta: int, mode: str = "decoupled") -> replay.RunConfig:
    return replay.RunConfig(
        eta=eta, mode=mode, seed=0, steps=STEPS, lr=1e-2, prompts=2, group=4, minibatches=1,
        max_new=4, threads=1,
    )  # fmt: skip


def varied_rewards(task: replay.Task) -> replay.Task:
    """The untrained tiny model never answers right, so every advantage would be 0 and the
    weights would never move: reward instead an even first completion token (the reward is
    not what is tested here)."""
    task.reward = lambda prompt, completion: float(bool(completion) and completion[0] % 2 == 0)  # type: ignore[method-assign]
    return task


def float64_logprobs(model_dir, state, rows: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith("lm_head") for name in missing)
    model.tie_weights()
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            out.append(logp.gather(1, ids[0, 1:, None])[:, 0])
    return out


def loss_token_gap(batch: replay.Batch, reference: list[torch.Tensor]) -> float:
    gap = 0.0
    for sample, ref in zip(batch.samples, reference, strict=True):
        for j, m in enumerate(sample.loss_mask):
            if m:
                gap = max(gap, abs(sample.behaviour[j] - float(ref[j - 1])))
    return gap


def test_each_step_samples_from_the_snapshot_eta_versions_old(tiny_model_dir):
    eta = 2
    task = varied_rewards(replay.Task(tiny_model_dir, heldout_size=4))
    run = replay.Replay(tiny_model_dir, task, config(eta))
    try:
        copies = {}  # the test's own copies of the weights, by version
        for step in range(STEPS):
            copies[run.version] = {k: v.clone() for k, v in run.worker.published_state().items()}
            batch = run.sample_batch(step)
            source = max(0, step - eta)
            assert batch.version == source
            for sample in batch.samples:
                assert {v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m} <= {
                    source
                }
            rows = [s.input_ids for s in batch.samples]
            gaps = {
                version: loss_token_gap(batch, float64_logprobs(tiny_model_dir, state, rows))
                for version, state in copies.items()
            }
            assert gaps[source] <= TOLERANCE, (step, gaps)
            others = [gap for version, gap in gaps.items() if version != source]
            assert all(gap > APART for gap in others), (step, gaps)
            run.train(batch)
    finally:
        run.close()


def test_eta_zero_is_on_policy(tiny_model_dir):
    task = varied_rewards(replay.Task(tiny_model_dir, heldout_size=4))
    run = replay.Replay(tiny_model_dir, task, config(0))
    try:
        for step in range(3):
            batch = run.sample_batch(step)
            assert batch.version == run.version == step
            plan = plan_step(batch.samples, 1, minibatch_count=1, max_tokens=4096)
            micros = plan.per_rank[0][0]
            proximal = run.worker.logprobs(micros)  # the worker's weights at the step's start
            gap = 0.0
            for micro, rows in zip(micros, proximal, strict=True):
                for behaviour, mask, prox in zip(
                    micro.behaviour, micro.loss_mask, rows, strict=True
                ):
                    pairs = zip(behaviour, mask, prox, strict=True)
                    gap = max([gap, *(abs(b - p) for b, m, p in pairs if m)])
            assert gap <= ON_POLICY
            stats = run.train(batch)
            # the step's own figure agrees: every loss token was fresh, and matched
            assert stats["mismatch_tokens"] == stats["tokens"] > 0
            assert stats["mismatch_sum"] <= ON_POLICY * stats["tokens"]
    finally:
        run.close()
