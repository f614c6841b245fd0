"""One FSDP2 training worker: a member of a torch.distributed group, run as a Ray actor.

A worker holds one shard of the model (``fully_shard`` per decoder layer, then the root: see
``trainer/model.py``) and of the AdamW state. Every call that touches the model is collective:
the driver calls it on all workers at once, and gives every worker the same number of
micro-batches (``MicroBatch`` may be empty; an empty one still runs a forward and backward so
the collectives line up).

The worker is the training backend (``trainer/backend.py``: a forward to per-token logprobs
on packed rows, backward, optimizer step) and the holder of the weights (export, broadcast,
checkpoints). The update itself, proximal logprobs, minibatches and the objective, is
``trainer/algorithm.py``'s, which `train_step` hands itself to. It knows nothing about
sessions, rewards, the server or Ray (``cluster`` wraps it in an actor).

A LoRA run (``WorkerSettings.lora``) holds the peft-wrapped model, sharded the same way: the
optimizer holds the adapter alone (the critic's value head reads the adapted trunk), the KL
reference is the same model with the adapter disabled, checkpoints hold the adapter and its
optimizer state, and a publish writes the adapter alone in peft's ``save_pretrained`` format
(``write_adapter_dir``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout

from trainer import failpoints
from trainer.algorithm import train_step as algorithm_step
from trainer.backend import EntropyMode, Forward
from trainer.batching import packed, shift_entropy, shift_entropy_with_grad, shift_logprobs
from trainer.config import AlgorithmConfig, LoraConfig, OptimConfig
from trainer.model import (
    adapter_state,
    checkpoint_names,
    load_model,
    load_sharded_model,
    output_embedding_name,
)
from trainer.plan import MicroBatch

# Files of a model directory that are not weights: copied next to every published version.
# How long a rank leaving the process group waits for the others to leave it too.
SHUTDOWN_WAIT_S = 20.0  # within the group's own wait (cluster.WorkerGroup.SHUTDOWN_WAIT_S)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs: the model, the optimizer, and the whole frozen algorithm (whose
    ``temperature`` is resolved: the run's). Each training step may bring the algorithm anew
    (the run's temperature can change between steps)."""

    model_dir: str
    lr: float
    optim: OptimConfig
    algorithm: AlgorithmConfig
    seed: int
    device: str  # "auto" | "cpu" | "cuda"
    threads: int
    lora: LoraConfig | None = None  # a LoRA run: train this adapter, the base frozen


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` only (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def pick_device(preference: str) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Worker:
    def __init__(self, rank: int, world_size: int, settings: WorkerSettings) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.algorithm = settings.algorithm  # this step's (train_step may bring another)
        self.step_count = 0
        self.rendezvous: socket.socket | None = None  # rank 0's listener, from address()

    # ----- setup ------------------------------------------------------------------------------

    def node(self) -> str:
        """Which node this worker runs on, in words (for messages)."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return f"node {ray.util.get_node_ip_address()} ({node_id[:12]})"

    def free_port(self, host: str) -> int:
        """A port free on this worker's node at ``host`` (for rank 0's weight group)."""
        with listen(host, 0) as s:
            return s.getsockname()[1]

    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the group's rendezvous (called on rank 0 only): this node's Ray
        address (127.0.0.1 for a local Ray) and a port held open until ``setup``."""
        import ray

        host = ray.util.get_node_ip_address()
        self.rendezvous = listen(host, 0)
        return host, self.rendezvous.getsockname()[1]

    def rendezvous_store(self, host: str, port: int) -> dist.TCPStore:
        """The group's store. Rank 0 serves it on a socket bound to ``host`` alone: left to
        itself, torch's store listens on every interface."""
        if self.rank != 0:
            return dist.TCPStore(host, port, self.world_size, False, timeout=default_pg_timeout)
        listener, self.rendezvous = self.rendezvous or listen(host, port), None
        return dist.TCPStore(
            host, port, self.world_size, True, timeout=default_pg_timeout,
            master_listen_fd=listener.detach(),  # the store owns (and closes) it now
        )  # fmt: skip

    def setup(self, master_address: str, master_port: int) -> dict[str, Any]:
        settings = self.settings
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        self.device = pick_device(settings.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=self.rendezvous_store(master_address, master_port),
            rank=self.rank,
            world_size=self.world_size,
        )
        torch.manual_seed(settings.seed)
        self.model = load_sharded_model(settings.model_dir, self.device, settings.lora)
        # tied embeddings: one tensor the state dict names twice; published and sent once
        self.output_embedding = output_embedding_name(self.model)
        self.reference_model = None
        if settings.algorithm.kl_coef > 0 and settings.lora is None:
            # a LoRA run's reference is its own model with the adapter disabled (`reference`)
            self.reference_model = load_sharded_model(settings.model_dir, self.device)
            self.reference_model.requires_grad_(False)
        # the adapter's dropout runs in the forward that takes the gradient only (`forward`)
        self.adapter_dropouts = [
            module
            for name, module in self.model.named_modules()
            if isinstance(module, torch.nn.Dropout) and ".lora_dropout." in name
        ]
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable_names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        adamw = self._adamw()
        self.optimizer = torch.optim.AdamW(trainable, **adamw)  # type: ignore[arg-type]
        # algorithm.critic: a value head on the last hidden state, zero at the start on every
        # worker (every value 0: GAE starts from the returns, and no value gradient reaches the
        # trunk before the head has learned), its gradient averaged in `step`; never published.
        self.value_head: torch.nn.Linear | None = None
        self.value_optimizer: torch.optim.Optimizer | None = None
        if settings.algorithm.critic:
            hidden = self.model.config.hidden_size
            self.value_head = torch.nn.Linear(hidden, 1, device=self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self.value_optimizer = torch.optim.AdamW(self.value_head.parameters(), **adamw)  # type: ignore[arg-type]
        return {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "device": str(self.device),
        }

    # ----- the backend (trainer/backend.py) ---------------------------------------------------

    def forward(
        self, micro: MicroBatch, *, grad: bool = False, entropy: EntropyMode = "none"
    ) -> Forward:
        for dropout in self.adapter_dropouts:
            dropout.train(grad)
        try:
            with torch.set_grad_enabled(grad):
                return self._forward(self.model, micro, entropy)
        finally:
            for dropout in self.adapter_dropouts:
                dropout.eval()

    def reference(self, micro: MicroBatch) -> torch.Tensor | None:
        if self.settings.lora is not None and self.algorithm.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                return self._forward(self.model, micro, "none").logprobs
        if self.reference_model is None:
            return None
        with torch.no_grad():
            return self._forward(self.reference_model, micro, "none").logprobs

    def values(self, micro: MicroBatch, *, grad: bool = False) -> torch.Tensor:
        if self.value_head is None:
            raise RuntimeError("values need algorithm.critic at the worker's setup")
        batch = packed(micro.rows or [[0]])  # an empty micro-batch still runs (collectives)
        position_ids = batch.position_ids.to(self.device)
        # the base model's last_hidden_state (after its final norm), taken by a hook: asking
        # the FSDP2 root for hidden_states would return views of its outputs. A LoRA run's
        # trunk is inside peft's wrapper (its adapters in place in the trunk's Linears).
        captured: list[torch.Tensor] = []
        causal_lm = self.model.get_base_model() if self.settings.lora else self.model
        hook = causal_lm.base_model.register_forward_hook(
            lambda _module, _args, out: captured.append(out.last_hidden_state)
        )
        try:
            with torch.set_grad_enabled(grad):
                self.model(
                    input_ids=batch.input_ids.to(self.device),
                    position_ids=position_ids,
                    cu_seq_lens_q=batch.cu_seqlens.to(self.device),
                    use_cache=False,
                )
        finally:
            hook.remove()
        with torch.set_grad_enabled(grad):
            value = self.value_head(captured[0][0].float()).squeeze(-1)
            before = torch.cat([value.new_zeros(1), value[:-1]])  # the state token t was drawn in
            return torch.where(position_ids[0] == 0, torch.zeros_like(before), before)

    def backward(self, loss: torch.Tensor) -> None:
        # FSDP2 averages gradients over workers; each worker's loss is a share of the global sum.
        (loss * self.world_size).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.value_optimizer is not None:
            for group in self.value_optimizer.param_groups:
                group["lr"] = lr * self.algorithm.value_lr_scale

    def step(self) -> float:
        clip = self.settings.optim.grad_clip
        limit = clip if clip > 0 else float("inf")
        if self.value_head is not None:
            return self._step_with_value_head(limit)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        return float(full)

    def _step_with_value_head(self, limit: float) -> float:
        """The head's gradient averaged over workers (as FSDP2 averages the model's), both
        clipped by their joint norm, both optimizers stepped; the joint norm."""
        assert self.value_head is not None and self.value_optimizer is not None
        head = [p.grad for p in self.value_head.parameters() if p.grad is not None]
        for grad in head:
            dist.all_reduce(grad)
            grad /= self.world_size
        model = [p.grad for p in self.model.parameters() if p.grad is not None]
        # torch's clip_grad_norm_ over the model's and the head's gradients together: the norm
        # of the per-tensor norms, then grad * min(1, limit / (norm + 1e-6))
        norms = [torch.linalg.vector_norm(grad) for grad in [*model, *head]]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        scale = torch.clamp(limit / (total + 1e-6), max=1.0)
        for grad in [*model, *head]:
            grad.mul_(scale.to(grad.dtype).item())
        self.optimizer.step()
        self.value_optimizer.step()
        return float(total)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.to(self.device, copy=True)  # NCCL reduces device tensors only
        dist.all_reduce(total)
        return total.to(tensor.device)

    def _forward(self, model: torch.nn.Module, micro: MicroBatch, entropy: EntropyMode) -> Forward:
        """Logprob of each packed token given the tokens before it in its row (0 at row starts),
        and the entropy of the distribution that predicted it, as ``entropy`` asks."""
        rows = micro.rows or [[0]]  # an empty micro-batch still runs so collectives line up
        batch = packed(rows)
        input_ids = batch.input_ids.to(self.device)
        cu_seqlens = batch.cu_seqlens.to(self.device)
        logits = model(
            input_ids=input_ids,
            position_ids=batch.position_ids.to(self.device),
            cu_seq_lens_q=cu_seqlens,  # rows attend within themselves (trainer/attention.py)
            use_cache=False,
        ).logits
        assert self.algorithm.temperature is not None, "resolve the run's temperature first"
        logits = logits[0].float() / self.algorithm.temperature
        entropies = None
        if entropy == "grad":
            entropies = shift_entropy_with_grad(logits, cu_seqlens)
        elif entropy == "detached":
            entropies = shift_entropy(logits.detach(), cu_seqlens)
        logprobs = shift_logprobs(logits, input_ids[0], cu_seqlens)
        return Forward(logprobs, entropies, batch.sequence_ids.to(self.device))

    @torch.no_grad()
    def logprobs(self, micros: list[MicroBatch]) -> list[list[list[float]]]:
        """Per micro-batch, per row, the current policy's logprob of each token."""
        out = []
        for micro in micros:
            values = self._forward(self.model, micro, "none").logprobs
            out.append(split_rows(values, [len(row) for row in micro.rows]))
        return out

    # ----- the update -------------------------------------------------------------------------

    def train_step(
        self,
        minibatches: list[list[MicroBatch]],
        tokens: list[int],
        sequences: list[int] | None = None,
        algorithm: AlgorithmConfig | None = None,
    ) -> dict[str, Any]:
        """One training step of ``trainer/algorithm.py`` on this worker (collective).

        ``tokens[i]`` and ``sequences[i]`` count the loss tokens and the rows holding any in
        minibatch ``i`` over all workers (`StepPlan`); left out, the workers count ``sequences``
        together (one all-reduce). ``algorithm`` (default: the settings') is the whole algorithm
        of this step. Returns this worker's sums (see ``algorithm.train_step``).
        """
        self.algorithm = algorithm or self.settings.algorithm
        if sequences is None:
            sequences = self._count_sequences(minibatches)
        step = self.step_count + 1
        marker = f"paused-at-rank{self.rank}"
        stats = algorithm_step(
            self,
            minibatches,
            tokens,
            sequences,
            self.algorithm,
            lr=self.scheduled_lr(),
            after_proximal=lambda: failpoints.reach("mid_step", step, Path("."), marker),
        )
        self.step_count += 1
        return stats

    def _count_sequences(self, minibatches: list[list[MicroBatch]]) -> list[int]:
        """Per minibatch, the rows holding a loss token, over all workers (collective)."""
        counts = [rows_with_loss(minibatch) for minibatch in minibatches]
        total = torch.tensor(counts, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(total)
        return [int(count) for count in total.tolist()]

    def scheduled_lr(self) -> float:
        """This step's learning rate: the run's, after a linear warm-up."""
        warmup = self.settings.optim.warmup_steps
        scale = min(1.0, (self.step_count + 1) / warmup) if warmup > 0 else 1.0
        return self.settings.lr * scale

    # ----- weights out ------------------------------------------------------------------------

    def full_state(self) -> dict[str, Any]:
        """The whole model's weights on CPU (collective; complete on rank 0 only); a LoRA
        run's under the wrapper's names, the base's included."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def published_state(self) -> dict[str, torch.Tensor]:
        """What a publish sends: the weights under the checkpoint format's names, without the
        tied output embedding, which loaders tie again; a LoRA run's adapter alone, under
        peft's names (collective; complete on rank 0 only)."""
        if self.settings.lora is not None:
            options = StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
            )
            adapter: dict[str, Any] = get_model_state_dict(self.model, options=options)
            return adapter_state(self.model, adapter) if self.rank == 0 else {}
        state = self.full_state()
        if self.rank != 0:
            return {}
        state = {name: t for name, t in state.items() if name != self.output_embedding}
        return checkpoint_names(self.model, state)

    def save_weights(self, out_dir: str) -> float:
        """Write the weights as a Hugging Face directory, a LoRA run's adapter as a peft one
        (collective; rank 0 writes)."""
        started = time.perf_counter()
        state = self.published_state()
        if self.rank == 0 and self.settings.lora is not None:
            config = self.model.peft_config["default"]
            write_adapter_dir(state, config, Path(self.settings.model_dir), Path(out_dir))
        elif self.rank == 0:
            write_model_dir(state, Path(self.settings.model_dir), Path(out_dir))
        dist.barrier()
        return time.perf_counter() - started

    def weight_metadata(self) -> dict[str, list]:
        """Names, dtypes and shapes of what ``broadcast_weights`` sends, in order."""
        names, dtypes, shapes = [], [], []
        for name, tensor in self.published_state().items():
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
        return {"names": names, "dtypes": dtypes, "shapes": shapes}

    def write_probe(self, weights_dir: str, token: str) -> str | None:
        """Rank 0 (the writer of every published version) writes the publish probe under
        ``weights_dir`` (absolute: the driver's, as every publish's path); its path (None on the
        other ranks)."""
        if self.rank != 0:
            return None
        from server.common.weights_probe import PROBE_NAME

        path = Path(weights_dir) / PROBE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(PROBE_NAME + ".tmp")
        tmp.write_text(token)
        os.replace(tmp, path)
        return str(path)

    # ----- the distributed weight path ----------------------------------------------------------

    def join_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str
    ) -> bool:
        """Rank 0 joins the engines' weight group as its rank 0 (the broadcast source)."""
        if self.rank != 0:
            return False
        from server.common.weight_transfer import join_group

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.weight_group = join_group(
            master_address, master_port, 0, world_size, group_name, backend
        )
        return True

    def broadcast_weights(self) -> float:
        """Gather the full weights and broadcast them to the engines (collective)."""
        started = time.perf_counter()
        state = self.published_state()
        if self.rank == 0:
            for tensor in state.values():
                dist.broadcast(tensor.to(self.device), group=self.weight_group, group_src=0)
        dist.barrier()
        return time.perf_counter() - started

    def _adamw(self) -> dict[str, Any]:
        optim = self.settings.optim
        return dict(
            lr=self.settings.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )

    # ----- weights in (a rollback) ------------------------------------------------------------

    def load_published(self, path: str | None) -> None:
        """The weights of a published version (``save_weights``'s directory: an adapter for a
        LoRA run, else full weights; None: the base model, version 0) in place of the model's,
        with a fresh optimizer state: what a rollback restores when no checkpoint of that
        version is left (collective; rank 0 reads)."""
        own: dict[str, Any] = {}
        if self.settings.lora is not None:  # collective: the adapter's names and its tensors
            options = StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
            )
            own = get_model_state_dict(self.model, options=options)
            own = {n: t for n, t in own.items() if n in self.trainable_names}
        state: dict[str, Any] = {}
        if self.rank == 0:
            state = self._published_tensors(path, own)
        options = self._state_options(broadcast_from_rank0=True)
        loaded = set_model_state_dict(self.model, state, options=options)
        if self.settings.lora is not None:
            missing = self.trainable_names & set(loaded.missing_keys)
            if missing or loaded.unexpected_keys:
                raise RuntimeError(
                    f"the adapter at {path} does not fit this model: missing {sorted(missing)}, "
                    f"unexpected {sorted(loaded.unexpected_keys)}"
                )
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, **self._adamw())  # type: ignore[arg-type]

    def _published_tensors(self, path: str | None, own: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's full state dict (the model's own names) of a published version; ``own``:
        a LoRA run's adapter now, whose names (and, for the base, whose A) it takes."""
        if self.settings.lora is None:
            return load_model(path or self.settings.model_dir).state_dict()
        if path is None:  # the base: every B zero (what an untrained adapter adds)
            return {n: torch.zeros_like(t) if ".lora_B." in n else t for n, t in own.items()}
        saved = load_file(str(Path(path) / "adapter_model.safetensors"))
        by_file_name = {adapter_file_name(n): n for n in own}
        if set(saved) != set(by_file_name):
            raise RuntimeError(
                f"the adapter at {path} does not fit this model: it holds {len(saved)} tensors "
                f"({sorted(saved)[0]}, ...), the model's adapter {len(by_file_name)} "
                f"({sorted(by_file_name)[0]}, ...)"
            )
        return {by_file_name[name]: tensor for name, tensor in saved.items()}

    # ----- checkpoints --------------------------------------------------------------------------

    def _state_options(self, **kwargs: Any) -> StateDictOptions:
        """Full state dicts; a LoRA run's hold the adapter alone (the base never changes)."""
        lora = self.settings.lora is not None
        return StateDictOptions(
            full_state_dict=True, ignore_frozen_params=lora, strict=not lora, **kwargs
        )

    def save_checkpoint(self, out_dir: str) -> None:
        """Model and optimizer as full state dicts in ``out_dir``; a LoRA run's adapter and its
        optimizer state alone (collective; rank 0 writes)."""
        options = self._state_options(cpu_offload=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.settings.lora is not None:  # a tied output embedding is no frozen parameter
            model_state = {n: t for n, t in model_state.items() if n in self.trainable_names}
        if self.rank == 0:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            state = {"model": model_state, "optimizer": optim_state, "step_count": self.step_count}
            state["lora"] = dataclasses.asdict(self.settings.lora) if self.settings.lora else None
            if self.value_head is not None and self.value_optimizer is not None:
                state["value_head"] = self.value_head.state_dict()
                state["value_optimizer"] = self.value_optimizer.state_dict()
            torch.save(state, out / "train_state.pt")
        dist.barrier()

    def load_checkpoint(self, in_dir: str) -> int:
        """Restore model and optimizer from ``save_checkpoint``'s files (collective)."""
        state: dict[str, Any] = {"model": {}, "optimizer": {}, "step_count": 0}
        if self.rank == 0:
            state = torch.load(Path(in_dir) / "train_state.pt", weights_only=True)
        self._check_checkpoint_kind(state.get("lora"), in_dir)
        options = self._state_options(broadcast_from_rank0=True)
        # Model, then optimizer, on every rank alike: set_state_dict takes the other ranks' empty
        # model state for "optimizer only" and skips the model's broadcasts that rank 0 makes.
        loaded = set_model_state_dict(self.model, state["model"], options=options)
        if self.settings.lora is not None:  # not strict: the frozen base is not in it
            missing = self.trainable_names & set(loaded.missing_keys)
            if missing or loaded.unexpected_keys:
                raise RuntimeError(
                    f"{in_dir}'s adapter does not fit this model: missing {sorted(missing)}, "
                    f"unexpected {sorted(loaded.unexpected_keys)}"
                )
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        if output_embedding_name(self.model) != self.output_embedding:
            raise RuntimeError("loading the checkpoint untied the input and output embeddings")
        counts = [state["step_count"]]
        dist.broadcast_object_list(counts, src=0)
        self.step_count = int(counts[0])
        if self.value_head is not None and self.value_optimizer is not None:
            head = [state.get("value_head"), state.get("value_optimizer")]
            dist.broadcast_object_list(head, src=0)
            if head[0] is None or head[1] is None:
                raise RuntimeError("the checkpoint holds no value head (algorithm.critic)")
            self.value_head.load_state_dict(head[0])
            self.value_optimizer.load_state_dict(head[1])
        return self.step_count

    def _check_checkpoint_kind(self, saved: dict[str, Any] | None, in_dir: str) -> None:
        """Refuse a full-weight checkpoint in a LoRA run, a LoRA one in a full-weight run, and
        an adapter of another shape (rank 0 read it; every rank raises alike)."""
        kinds = [saved if self.rank == 0 else None]
        dist.broadcast_object_list(kinds, src=0)
        wanted = dataclasses.asdict(self.settings.lora) if self.settings.lora else None
        if kinds[0] != wanted:
            say = lambda kind: f"a LoRA adapter {kind}" if kind else "full weights"  # noqa: E731
            raise RuntimeError(
                f"{in_dir} holds {say(kinds[0])}, but this run trains {say(wanted)}: give the "
                "run an output_dir of its own, or the lora settings the checkpoint was made with"
            )

    def shutdown(self) -> None:
        """Leave the process group once every rank has come to leave it (gloo): a rank that
        destroyed its group while another still used it could die at exit ("terminate called
        without an active exception"). A rank that never comes is waited for SHUTDOWN_WAIT_S."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "gloo":
            with contextlib.suppress(RuntimeError):
                dist.monitored_barrier(timeout=timedelta(seconds=SHUTDOWN_WAIT_S))
        dist.destroy_process_group()


def rows_with_loss(micros: list[MicroBatch]) -> int:
    return sum(1 for micro in micros for mask in micro.loss_mask if any(mask))


def split_rows(values: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """Packed per-token values back into rows of ``lengths``."""
    flat, start, out = values.tolist(), 0, []
    for length in lengths:
        out.append(flat[start : start + length])
        start += length
    return out


def write_model_dir(
    state: dict[str, torch.Tensor], base: Path, out: Path, tied_name: str | None = None
) -> None:
    """A Hugging Face model directory: the base model's config and tokenizer, new safetensors.
    ``tied_name`` (the output embedding of a tied model, the input embedding under a second
    name) is left out, as ``save_pretrained`` leaves it out: the loader ties it again."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: tensor.contiguous() for name, tensor in state.items() if name != tied_name}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    for name in MODEL_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    (tmp / "proxrl.json").write_text(json.dumps({"base_model": str(base)}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # readers never see a half-written directory


def adapter_file_name(name: str) -> str:
    """The name peft's ``save_pretrained`` gives the adapter tensor the wrapped model calls
    ``name`` (the adapter's name, "default", left out)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def write_adapter_dir(state: dict[str, torch.Tensor], config: Any, base: Path, out: Path) -> None:
    """A peft adapter directory, as ``save_pretrained`` writes one: ``adapter_config.json``
    (the peft ``LoraConfig``, naming the base model's directory) and
    ``adapter_model.safetensors`` (``state``: peft's names), plus ``proxrl.json``."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = copy.copy(config)
    config.base_model_name_or_path = str(base)
    config.save_pretrained(str(tmp))
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "proxrl.json").write_text(json.dumps({"base_model": str(base), "adapter": True}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # readers never see a half-written directory
