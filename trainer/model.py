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

A LoRA run (``TrainConfig.lora``) wraps the loaded model with peft before it is sharded
(``with_lora``): the base frozen, an adapter on each target Linear of the decoder layers
(``lora_targets``, checked against the model at start by ``check_supported``), B at zero so that
the adapter starts as the base model. ``adapter_state`` turns the wrapper's state into peft's
``save_pretrained`` names.

This module knows nothing of PPO, Ray or the server.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from server.common import architecture
from server.common.architecture import UnsupportedModel
from trainer import attention
from trainer.config import ConfigError, LoraConfig

__all__ = [
    "UnsupportedModel",
    "adapter_state",
    "check_attention",
    "check_supported",
    "checkpoint_names",
    "decoder_layers",
    "load_model",
    "load_sharded_model",
    "lora_targets",
    "output_embedding_name",
    "with_lora",
]


def check_supported(model_dir: str | Path, lora: LoraConfig | None = None) -> None:
    """Refuse a checkpoint whose attention the trainer does not compute, naming every feature;
    with ``lora``, refuse targets the model does not have (on a weightless copy of it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    architecture.check_supported(config, model_dir)
    if lora is not None:
        with torch.device("meta"):
            lora_targets(AutoModelForCausalLM.from_config(config), lora)


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


def lora_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """The module-name suffixes that get an adapter: ``lora.target_modules``, each checked to
    name a Linear of the decoder layers (as peft matches them: the whole path or its end after
    a dot), or by default the last names of every Linear there (the attention and MLP
    projections the model has). Raises ConfigError naming ``lora.target_modules``."""
    inside = {
        name
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    available = sorted({name.rsplit(".", 1)[-1] for name in inside})
    if not lora.target_modules:
        if not available:
            raise ConfigError("lora.target_modules", "the decoder layers hold no Linear module")
        return available
    missing = [
        target
        for target in lora.target_modules
        if not any(name == target or name.endswith("." + target) for name in inside)
    ]
    if missing:
        raise ConfigError(
            "lora.target_modules",
            f"{', '.join(missing)}: no Linear module of {type(model).__name__}'s decoder layers "
            f"is named so (its Linear modules there: {', '.join(available)})",
        )
    return list(lora.target_modules)


def with_lora(model: Any, lora: LoraConfig) -> Any:
    """``model`` wrapped by peft: the base frozen, an adapter on each of ``lora_targets`` (A
    random, B zero: the wrapped model computes what the base does until B moves)."""
    import peft

    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # annotated int; any number scales
        target_modules=lora_targets(model, lora),
        lora_dropout=lora.dropout,
        use_rslora=lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return peft.get_peft_model(model, config)


def adapter_state(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of ``state`` (the peft-wrapped ``model``'s state dict, or its
    trainable part) under peft's ``save_pretrained`` names: ``base_model.model.<module
    path>.lora_A.weight`` and ``...lora_B.weight``, the adapter's name left out."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=state)
    return {name: tensor.contiguous() for name, tensor in adapter.items()}


def load_sharded_model(model_dir: str, device: torch.device, lora: LoraConfig | None = None) -> Any:
    """``load_model`` (wrapped ``with_lora`` for a LoRA run), each decoder layer and then the
    root wrapped by FSDP2, sharded over the
    process group on ``device``'s kind (left to itself, FSDP2 makes its mesh on CUDA whenever
    the machine has a GPU: a worker asked to train on the CPU there failed its first step with
    tensors on two devices). Tied embeddings are checked to be one tensor still after sharding."""
    model = load_model(model_dir).to(device)
    if lora is not None:
        model = with_lora(model, lora)
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
