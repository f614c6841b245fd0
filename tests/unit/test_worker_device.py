"""A worker asked to train on the CPU shards its model on the CPU, also on a machine with a GPU.

Left to itself, FSDP2 makes its device mesh on the machine's accelerator (``torch._C.
_get_accelerator``): on a GPU machine a worker with ``cluster.device: cpu`` got its parameters'
mesh on CUDA and failed its first step with tensors on two devices (seen on an H200 with the
forced-staleness replay). Here the machine is made to report an accelerator this process cannot
use (``meta``): the worker must not ask for it, and its parameters' mesh must be the CPU's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support import start_worker


def test_a_cpu_worker_shards_on_the_cpu_whatever_the_machine_has(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("meta"))
    worker = start_worker(tiny_model_dir)
    try:
        parameters = list(worker.model.parameters())
        assert parameters and all(isinstance(p, DTensor) for p in parameters)
        assert {p.device_mesh.device_type for p in parameters} == {"cpu"}
        assert {p.device.type for p in parameters} == {"cpu"}
    finally:
        worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
