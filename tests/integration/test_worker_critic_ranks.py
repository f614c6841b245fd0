"""Two FSDP2 workers (two processes, gloo on loopback) make the step one plain backend makes on
all their rows, with the algorithm's batch-wide statistics: REINFORCE++'s whitening of the
KL-shaped advantages and the critic's whitened GAE need the mean and std over every worker's
loss tokens (`Backend.reduce_sum`), and the critic's value head, one copy per worker, needs its
gradient averaged over them. A worker that whitened over its own tokens only, or stepped its
head on its own gradient, would train other weights than the plain backend's. The baseline
case (neither option) shows the float32 noise floor the tolerances sit above."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.support import free_port, run_ranks
from tests.unit.test_algorithm import (
    largest_gap,
    make_samples,
    plain_twin,
    random_rows,
    row_logprobs,
    weights,
    with_rewards,
)
from trainer.algorithm import train_step
from trainer.config import AlgorithmConfig, OptimConfig
from trainer.model import load_model
from trainer.plan import plan_step

pytestmark = pytest.mark.slow  # two worker processes per case: about 30 s each here

ALGORITHMS = {
    "baseline": dict(),
    "kl_in_reward": dict(decoupled=False, kl_coef=0.1, kl_in_reward=True),
    "critic": dict(critic=True, value_clip=0.05),
}
# float32, two workers' sums against one's. The grad norms (before any update, then after one)
# agree to 3e-6 relative with or without these options (measured); the weights after AdamW's
# two steps less well, with or without them (1.8e-3 to 1.8e-2 of the change measured): its
# first steps move an entry by about lr whatever its gradient's size, so rounding in a gradient
# near 0 moves the weight by up to lr. A worker whitening over its own tokens only changes the
# grad norms by 6e-3 to 1.1e-2 relative (measured); one that steps its value head on its own
# gradient, by 1.8e-3 relative.
NORM_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 5e-2  # of the largest weight change

WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from tests.integration.test_worker_critic_ranks import algorithm_of, samples_of
    from trainer.config import OptimConfig
    from trainer.plan import plan_step
    from trainer.worker import Worker, WorkerSettings

    rank, model_dir, out, port, name = sys.argv[1:6]
    rank, port = int(rank), int(port)
    torch.set_num_threads(1)
    algorithm = algorithm_of(name)
    plan = plan_step(samples_of(model_dir), 2, minibatch_count=2, max_tokens=64)
    settings = WorkerSettings(model_dir, 1e-3, OptimConfig(grad_clip=1.0), algorithm, 0, "cpu", 1)
    worker = Worker(rank, 2, settings)
    worker.setup("127.0.0.1", port)
    head = worker.value_head
    start = {k: v.clone() for k, v in head.state_dict().items()} if head is not None else {}
    stats = worker.train_step(plan.per_rank[rank], plan.tokens, plan.sequences, algorithm)
    state = worker.full_state()
    trained = {k: v.clone() for k, v in head.state_dict().items()} if head is not None else {}
    norms = stats["grad_norms"]
    if rank == 0:
        torch.save({"model": state, "head_start": start, "head": trained, "grad_norms": norms}, out)
    print(f"rank {rank} done", flush=True)
    worker.shutdown()
    """
)


def algorithm_of(name: str) -> AlgorithmConfig:
    return AlgorithmConfig(
        temperature=0.7, behaviour_cap=5.0, entropy_coef=0.01, **ALGORITHMS[name]
    )


def samples_of(model_dir):
    from transformers import AutoModelForCausalLM

    scorer = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        samples = make_samples(
            lambda ids: [0.0, *row_logprobs(scorer, ids)[0].tolist()], random_rows(5, 9), 5
        )
    return with_rewards(samples, 5)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_two_workers_make_the_plain_backend_s_step(tiny_model_dir, tmp_path, name):
    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, 2, tiny_model_dir, out, free_port(), name)
    sharded = torch.load(out, weights_only=True)

    algorithm = algorithm_of(name)
    samples = samples_of(tiny_model_dir)
    plan = plan_step(samples, 1, minibatch_count=2, max_tokens=64)
    assert len(plan.per_rank[0]) == 2
    model = load_model(tiny_model_dir)
    backend = plain_twin(
        model, sharded["head_start"], OptimConfig(grad_clip=1.0), tiny_model_dir, algorithm
    )
    head = backend.value_head
    before = weights(model)
    plain = train_step(backend, plan.per_rank[0], plan.tokens, plan.sequences, algorithm, lr=1e-3)

    trained = weights(model)
    change = largest_gap(trained, before)
    assert change > 1e-4
    assert sharded["grad_norms"] == pytest.approx(plain["grad_norms"], rel=NORM_TOLERANCE)
    gap = largest_gap({k: sharded["model"][k] for k in trained}, trained)
    assert gap <= WEIGHT_TOLERANCE * change
    if head is not None:
        head_change = largest_gap(head.state_dict(), sharded["head_start"])
        assert head_change > 1e-4
        assert largest_gap(sharded["head"], head.state_dict()) <= WEIGHT_TOLERANCE * head_change
