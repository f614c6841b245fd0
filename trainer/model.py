"""The policy model as the trainer holds it: loaded with the packed attention, checked, sharded.

``load_model`` loads a Hugging Face checkpoint the way every worker does (float32, the packed
attention of ``trainer/attention.py``) after refusing a model whose attention neither the
trainer nor the engine computes (``server.common.architecture.unsupported_features``), so the
trainer never trains another model than the one it was given. ``decoder_layers`` finds the
modules FSDP2 shards one by one in any architecture, from the model's own declaration
(``_no_split_modules``: the classes transformers keeps whole when it splits a model), not from
one architecture's attribute path. ``output_embedding_name`` says whether the output embedding
is the input embedding (tied) and, if so, under which name the state dict repeats it, so
that what is published and checkpointed keeps the tie. ``check_attention`` runs one tiny
forward at start, so that an attention the packed attention refuses stops the trainer there.

This module knows nothing of PPO, Ray or the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from server.common import architecture
from server.common.architecture import UnsupportedModel
from trainer import attention

__all__ = [
    "UnsupportedModel",
    "check_attention",
    "check_supported",
    "checkpoint_names",
    "decoder_layers",
    "load_model",
    "load_sharded_model",
    "output_embedding_name",
]


def check_supported(model_dir: str | Path) -> None:
    """Refuse a checkpoint whose attention the trainer does not compute, naming every feature."""
    from transformers import AutoConfig

    architecture.check_supported(AutoConfig.from_pretrained(model_dir), model_dir)


def load_model(model_dir: str | Path) -> Any:
    """The checkpoint in float32 with the trainer's packed attention, after ``check_supported``."""
    from transformers import AutoModelForCausalLM

    check_supported(model_dir)
    attention.register()
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention.NAME
    )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of the classes the model declares in ``_no_split_modules``, innermost first
    (FSDP2 shards nested ones before the modules holding them)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise UnsupportedModel(
            f"cannot find the decoder layers of {type(model).__name__} to shard: it declares "
            f"no layer classes (_no_split_modules={sorted(names)}) or none of them is in it"
        )
    return layers[::-1]


def load_sharded_model(model_dir: str, device: torch.device) -> Any:
    """``load_model``, each decoder layer and then the root wrapped by FSDP2, sharded over the
    process group on ``device``'s kind (left to itself, FSDP2 makes its mesh on CUDA whenever
    the machine has a GPU: a worker asked to train on the CPU there failed its first step with
    tensors on two devices). Tied embeddings are checked to be one tensor still after sharding."""
    model = load_model(model_dir).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    tied = output_embedding_name(model) is not None
    mixed = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        reduce_dtype=torch.float32,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    if (output_embedding_name(model) is not None) != tied:
        raise UnsupportedModel("sharding the model untied its input and output embeddings")
    check_attention(model, device, model_dir)
    return model


def check_attention(model: Any, device: torch.device, where: str | Path) -> None:
    """One forward of a two-token row, so that an attention keyword the packed attention refuses
    (attention sinks, position biases, ...) stops the trainer at start, not at its first step.
    Collective under FSDP2: every worker runs it."""
    row = {
        "input_ids": torch.zeros((1, 2), dtype=torch.long, device=device),
        "position_ids": torch.arange(2, device=device)[None],
        "cu_seq_lens_q": torch.tensor([0, 2], dtype=torch.int32, device=device),
    }
    try:
        with torch.no_grad():
            model(**row, use_cache=False)
    except ValueError as exc:
        raise UnsupportedModel(f"proxrl cannot train {where}: {exc}") from exc
    finally:
        # FSDP2 keeps the root's parameters gathered after a forward (a backward would follow);
        # shard them again, or an optimizer made next would hold the gathered copies, whose
        # updates the next gather discards.
        model.reshard()


def checkpoint_names(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's own names) under the checkpoint format's names: what
    ``save_pretrained`` writes and what SGLang and ``from_pretrained`` load. transformers 5
    renames or fuses some tensors on load (GPT-NeoX's ``embed_out`` is ``lm_head``, a MoE
    layer's experts are one stacked tensor); this undoes it with transformers' own mapping.
    Identity for architectures without a conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    with torch.no_grad():
        reverted = revert_weight_conversion(model, dict(state))
    return {name: tensor.contiguous() for name, tensor in reverted.items()}


def output_embedding_name(model: Any) -> str | None:
    """The state-dict name of the output embedding's weight when it is the input embedding's
    (tied: one tensor under two names), else None. Raises if the loaded model and its config
    disagree about the tie."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    declared = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied != declared:
        raise UnsupportedModel(
            f"{type(model).__name__}'s config says tie_word_embeddings={declared}, but its output "
            f"embedding {'is' if tied else 'is not'} its input embedding"
        )
    if not tied:
        return None
    name = next(name for name, module in model.named_modules() if module is output)
    return f"{name}.weight"
