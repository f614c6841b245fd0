"""A LoRA run on two FSDP2 workers (two processes, gloo on loopback).

One step on the two ranks' shares of a batch moves the adapter as one worker's step on the
whole batch does: the published adapters agree to ``TOLERANCE`` = 1e-6 of the largest B
(measured: 1.8e-10 against 6.3e-4, float32 gradients summed in another order). AdamW's epsilon
is 1 here, so that its first steps follow the gradient's size, not only its sign, and a
gradient averaged wrongly over the ranks shows. Every base tensor stays equal to the bit on
both ranks, and the checkpoint (rank 0 reads it, rank 1 takes its share by broadcast) restores
the adapter to the bit."""

from __future__ import annotations

import textwrap

import pytest
from safetensors.torch import load_file

from tests.support import free_port, run_ranks

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6

WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from tests.unit.test_trainer_lora import ALGORITHM, steps
    from trainer.config import LoraConfig, OptimConfig
    from trainer.worker import Worker, WorkerSettings

    torch.set_num_threads(1)
    rank, world, model_dir, out, port = sys.argv[1:6]
    rank, world = int(rank), int(world)
    lora = LoraConfig(rank=4, alpha=8.0)
    optim = OptimConfig(eps=1.0)  # Adam near SGD: its update follows the gradient's scale
    settings = WorkerSettings(model_dir, 1e-2, optim, ALGORITHM, 0, "cpu", 1, lora)
    worker = Worker(rank, world, settings)
    worker.setup("127.0.0.1", int(port))
    def weights(trainable):
        return {
            n: p.detach().full_tensor().clone()
            for n, p in worker.model.named_parameters() if p.requires_grad == trainable
        }
    base = weights(False)
    plan = steps(3, world)
    worker.train_step(plan.per_rank[rank], plan.tokens, plan.sequences, ALGORITHM)
    assert all(torch.equal(base[n], t) for n, t in weights(False).items()), "base moved"
    trained = weights(True)
    worker.save_weights(os.path.join(out, "published"))
    worker.save_checkpoint(os.path.join(out, "checkpoint"))
    with torch.no_grad():
        for parameter in worker.model.parameters():
            if parameter.requires_grad:
                parameter.zero_()
    worker.load_checkpoint(os.path.join(out, "checkpoint"))
    assert all(torch.equal(trained[n], t) for n, t in weights(True).items()), "not restored"
    print(f"rank {rank} done", flush=True)
    worker.shutdown()
    """
)


def run_workers(world: int, model_dir, out) -> None:
    outputs = run_ranks(WORKER, world, world, model_dir, out, free_port())
    for rank, output in enumerate(outputs):
        assert f"rank {rank} done" in output


def test_two_workers_train_checkpoint_and_publish_the_adapter(tiny_model_dir, tmp_path):
    run_workers(1, tiny_model_dir, tmp_path / "one")
    run_workers(2, tiny_model_dir, tmp_path / "two")
    one = load_file(tmp_path / "one" / "published" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "published" / "adapter_model.safetensors")
    assert set(one) == set(two) and one
    b_change = max(float(t.abs().max()) for n, t in one.items() if "lora_B" in n)
    assert b_change > 1e-4  # B left zero: the step moved it
    gap = max(float((one[n] - two[n]).abs().max()) for n in one)
    print(f"one worker against two: largest gap {gap:.3g}, largest B {b_change:.3g}")
    assert gap <= TOLERANCE * b_change
