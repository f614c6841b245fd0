"""Two FSDP2 workers (two processes, gloo on loopback) save a checkpoint and load it back: the
ranks' collectives must line up. ``set_state_dict`` took rank 1's empty model state (only rank
0 reads the file) for "optimizer only" and skipped the model's broadcasts, so every trainer of
``world_size`` 2 or more failed to resume (rank 1: ``int()`` of a dict), found by the two-node
drill (tests/reliability/test_trainer_nodes.py)."""

from __future__ import annotations

import textwrap

from tests.support import free_port, run_ranks

WORKER = textwrap.dedent(
    """
    import dataclasses, os, sys
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.worker import Worker, WorkerSettings

    rank, model_dir, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    algorithm = dataclasses.replace(AlgorithmConfig(), temperature=1.0)
    settings = WorkerSettings(model_dir, 1e-3, OptimConfig(), algorithm, 0, "cpu", 1)
    worker = Worker(rank, 2, settings)
    worker.setup("127.0.0.1", port)
    worker.step_count = 7
    before = {k: v.full_tensor().clone() for k, v in worker.model.state_dict().items()}
    worker.save_checkpoint(out)
    with torch.no_grad():
        for parameter in worker.model.parameters():
            parameter.zero_()
    worker.step_count = 0
    step = worker.load_checkpoint(out)
    after = {k: v.full_tensor() for k, v in worker.model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before), "weights not restored"
    print(f"rank {rank} resumed at step {step}", flush=True)
    worker.shutdown()
    """
)


def test_two_workers_resume_from_their_checkpoint(tiny_model_dir, tmp_path):
    outputs = run_ranks(WORKER, 2, tiny_model_dir, tmp_path, free_port())
    for rank, output in enumerate(outputs):
        assert f"rank {rank} resumed at step 7" in output
