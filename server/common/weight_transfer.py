"""Where new weights come from: a Hugging Face directory on disk, or a torch.distributed broadcast.

``read_checkpoint`` reads the safetensors of a model directory by parameter name.
``WeightGroup`` is one named process group shared with a trainer, formed the way SGLang, verl,
AReaL and slime form it (a TCP rendezvous at the trainer, a ``PrefixStore`` named after the
group, and a group of its own beside any default one), so a trainer written for SGLang can
broadcast to this engine unchanged. The trainer is rank 0 and the source of every broadcast.

This module only produces ``{name: tensor}``; the scheduler decides when they go in.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed import distributed_c10d as c10d

DEFAULT_GROUP_TIMEOUT = timedelta(minutes=10)


class WeightLoadError(ValueError):
    pass


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``model_path`` (sharded or not), by name."""
    root = Path(model_path)
    if not root.is_dir():
        raise WeightLoadError(f"model_path {str(root)!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(root)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(root / name))
    return tensors


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: timedelta = DEFAULT_GROUP_TIMEOUT,
) -> dist.ProcessGroup:
    """Form (or join) the named group; blocks until all ``world_size`` ranks have joined.

    Rank 0 hosts the rendezvous store. The group lives beside the default process group (there
    may be none), so several named groups can exist in one process.
    """
    if rank == 0:
        # Left to itself torch's store listens on every interface for the group's whole life:
        # rank 0 serves it on ``master_address`` alone (the address the other ranks are given).
        family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
        listener = socket.create_server((master_address, master_port), family=family)
        store: dist.Store = dist.TCPStore(
            master_address, master_port, world_size, True, timeout=timeout,
            master_listen_fd=listener.detach(),  # the store owns (and closes) it now
        )  # fmt: skip
    else:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    # Ranks of this group are its own global ranks (there is no default group to map them to).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightLoadError(f"unknown dtype {name!r}")
    return dtype


def receive_broadcast(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: torch.device,
    flattened: bool = False,
) -> dict[str, torch.Tensor]:
    """Receive the tensors rank 0 broadcasts, one per name or one flattened bucket.

    A flattened bucket is one 1-D broadcast of every tensor, in order, of one common dtype
    (UNVERIFIED: the reference names ``load_format="flattened_bucket"`` without its layout).
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightLoadError("names, dtypes and shapes must have the same length")
    torch_dtypes = [parse_dtype(d) for d in dtypes]
    if not flattened:
        received = {}
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, group=group, group_src=0)
            received[name] = tensor
        return received
    if len(set(torch_dtypes)) != 1:
        raise WeightLoadError("a flattened bucket needs one dtype for all tensors")
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=torch_dtypes[0], device=device)
    dist.broadcast(flat, group=group, group_src=0)
    parts = flat.split(sizes)
    return {name: part.view(shape) for name, part, shape in zip(names, parts, shapes, strict=True)}
