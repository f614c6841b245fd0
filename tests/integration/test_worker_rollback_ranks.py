"""A rollback's restore from published files on two FSDP2 workers (two processes, gloo on
loopback): ``Worker.load_published`` puts back, bit for bit on every rank, the weights a version
was published with (a LoRA run's adapter directory, or full weights), with a fresh optimizer
state; None, the base model (a LoRA run's B all zero, a full-weight run's served model)."""

from __future__ import annotations

import textwrap

import pytest

from tests.support import free_port, run_ranks

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from tests.unit.test_trainer_lora import ALGORITHM, steps
    from trainer.config import LoraConfig, OptimConfig
    from trainer.worker import Worker, WorkerSettings

    torch.set_num_threads(1)
    rank, world, model_dir, out, port, kind = sys.argv[1:7]
    rank, world = int(rank), int(world)
    lora = LoraConfig(rank=4, alpha=8.0) if kind == "lora" else None
    settings = WorkerSettings(model_dir, 1e-2, OptimConfig(), ALGORITHM, 0, "cpu", 1, lora)
    worker = Worker(rank, world, settings)
    worker.setup("127.0.0.1", int(port))
    def weights():
        return {
            n: p.detach().full_tensor().clone()
            for n, p in worker.model.named_parameters() if p.requires_grad
        }
    base = weights()
    plan = steps(3, world)
    worker.train_step(plan.per_rank[rank], plan.tokens, plan.sequences, ALGORITHM)
    first = weights()
    worker.save_weights(os.path.join(out, "v1"))
    worker.train_step(plan.per_rank[rank], plan.tokens, plan.sequences, ALGORITHM)
    assert any(not torch.equal(first[n], t) for n, t in weights().items()), "no step"
    assert worker.optimizer.state, "the optimizer has state before the restore"
    worker.load_published(os.path.join(out, "v1"))
    assert all(torch.equal(first[n], t) for n, t in weights().items()), "v1 not restored"
    assert not worker.optimizer.state, "the optimizer state is not fresh"
    worker.train_step(plan.per_rank[rank], plan.tokens, plan.sequences, ALGORITHM)  # trains on
    worker.load_published(None)
    if lora is None:
        assert all(torch.equal(base[n], t) for n, t in weights().items()), "not the base"
    else:
        restored = weights()
        assert all(not t.any() for n, t in restored.items() if ".lora_B." in n), "B not zero"
        assert all(torch.equal(base[n], t) for n, t in restored.items() if ".lora_B." in n)
    print(f"rank {rank} done", flush=True)
    worker.shutdown()
    """
)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_workers_restore_a_published_version_bit_for_bit(kind, tiny_model_dir, tmp_path):
    outputs = run_ranks(WORKER, 2, 2, tiny_model_dir, tmp_path, free_port(), kind)
    for rank, output in enumerate(outputs):
        assert f"rank {rank} done" in output
