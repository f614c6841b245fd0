"""LoRA adapters served on the engine's one base model: read, checked, held, applied per row.

An adapter is a directory in peft's ``save_pretrained`` format: ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``
for each target ``nn.Linear``. A target's output becomes (Hu et al. 2021, eq. 3)

    h = W0 x + scale * B A x,    scale = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)

for the rows of a batch that asked for that adapter; other rows get ``W0 x`` alone. The base
weights are never changed: each target module carries a forward hook that adds the deltas of
the adapters in the current batch (:meth:`AdapterBank.batch` says which row holds which), and
the fused decode step (``fast_decode``) calls :meth:`AdapterBank.add_fused` on its fused outputs.

What is refused, at load, with the reason: another ``peft_type`` than LORA, DoRA, bias adapters,
``modules_to_save``, per-module ranks or alphas (``rank_pattern``, ``alpha_pattern``), a regex
``target_modules``, a target that names no ``nn.Linear`` of the model, a tensor for a module the
config does not target, a missing A or B, a shape that does not fit its module.

The bank holds at most ``max_loaded`` adapters (``--max-loaded-loras``). A request holds its
adapter (``acquire``/``release``) from submission to its end; ``retire`` takes a name out of
service at once, and the adapter's tensors are dropped when its last request ends (what SGLang
does on unload). This module knows nothing about requests, HTTP or the scheduler.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
# Config keys whose non-default values change what the adapter computes in ways we do not serve.
REFUSED: dict[str, tuple] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None,),
    "layers_pattern": (None, []),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "exclude_modules": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
}


class AdapterError(ValueError):
    """An adapter the engine refuses (a bad directory, a name taken or unknown, the bound)."""


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: its target modules' weights, on the engine's device and dtype."""

    name: str
    path: str
    weights: dict[nn.Module, LoraWeights]
    rank: int
    pinned: bool = False
    uid: int = 0  # unique per load: a prefix-cache key that an unload and reload never share
    users: int = 0  # requests holding it
    retired: bool = False
    freed: Future = field(default_factory=Future)  # set when its tensors are dropped

    @property
    def nbytes(self) -> int:
        return sum(
            w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
            for w in self.weights.values()
        )


def read_adapter(
    path: str | Path, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> tuple[dict[nn.Module, LoraWeights], int]:
    """The weights of the adapter in ``path`` by target module of ``model``, and its rank;
    AdapterError naming what is wrong when the directory is not an adapter we serve."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"lora_path {path}: no such directory")
    config = _read_config(directory)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets: list[str] = config["target_modules"]
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = [t for t in targets if not any(_targets(name, [t]) for name in linears)]
    if unmatched:
        raise AdapterError(
            f"{CONFIG_FILE}: target_modules {unmatched} name no linear module of the model"
        )
    tensors = _read_tensors(directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_name, part = _split_key(key)
        if module_name not in linears or not _targets(module_name, targets):
            raise AdapterError(
                f"{WEIGHTS_FILE}: {key} is for {module_name!r}, which is not a linear module "
                f"of the model matched by target_modules {targets}"
            )
        pairs.setdefault(module_name, {})[part] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE}: no lora_A/lora_B tensors in it")
    weights: dict[nn.Module, LoraWeights] = {}
    for module_name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            missing = sorted({"lora_A", "lora_B"} - set(pair))
            raise AdapterError(f"{WEIGHTS_FILE}: {module_name} has no {missing[0]}")
        linear = linears[module_name]
        a, b = pair["lora_A"], pair["lora_B"]
        expected_a = (rank, linear.in_features)
        expected_b = (linear.out_features, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise AdapterError(
                f"{WEIGHTS_FILE}: {module_name} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; r={rank} on this module needs {expected_a} and {expected_b}"
            )
        a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        # One adapter's NaN or inf would reach every row of a batch it shares (0 x NaN is NaN in
        # the mixed batch's masked matmuls) and the prefix cache after it: a diverged run's
        # adapter is refused, never served.
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterError(
                f"{WEIGHTS_FILE}: {module_name} has entries that are not finite (NaN or inf) "
                f"in {dtype}: the adapter is refused"
            )
        weights[linear] = LoraWeights(a, b, scale)
    return weights, rank


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"lora_path {directory}: no {CONFIG_FILE} in it") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE}: not a JSON object")
    _check_shape(config)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config['peft_type']!r}; only LORA is served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias {config['bias']!r}; only 'none' is served")
    for key, allowed in REFUSED.items():
        if config.get(key) not in allowed:
            raise AdapterError(f"{CONFIG_FILE}: {key}={config[key]!r} is not served")
    return config


def _check_shape(config: dict) -> None:
    """``r``, ``lora_alpha`` and ``target_modules`` are what the deltas are computed from."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(
            f"{CONFIG_FILE}: target_modules must be a non-empty list of module names "
            f"(suffixes such as 'q_proj'), got {targets!r}"
        )


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"lora_path {directory}: no {WEIGHTS_FILE} in it")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE}: not a readable safetensors file ({exc})") from None


def _split_key(key: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` as (module, "lora_A")."""
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if key.startswith(KEY_PREFIX) and key.endswith(suffix):
            return key[len(KEY_PREFIX) : -len(suffix)], part
    raise AdapterError(
        f"{WEIGHTS_FILE}: {key!r} is not a LoRA weight "
        f"({KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight; bias and DoRA tensors "
        "are not served)"
    )


def _targets(module_name: str, targets: list[str]) -> bool:
    """peft's rule for a list: a target is the module's full name or its last dotted parts."""
    return any(module_name == t or module_name.endswith(f".{t}") for t in targets)


# ----- the bank ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stack:
    a: torch.Tensor  # the A of every adapter targeting a module, stacked: [sum r, in]
    b: torch.Tensor  # their B times their scale, side by side: [out, sum r]
    layout: tuple[int, ...]  # for each rank column, its adapter's index in the batch's
    columns: torch.Tensor  # the layout as a tensor on the device


@dataclass
class _Mixed:
    """A batch whose rows hold different adapters (or some none): per target module, the
    adapters' A stacked ``[sum r, in]`` and scaled B side by side ``[out, sum r]``, and a 0/1
    mask ``[rows, sum r]`` that keeps each row's own adapter's columns. One pair of matmuls per
    module however many adapters share the batch; rows of no adapter get exactly zero."""

    adapters: tuple[Adapter, ...]  # the batch's adapters, in order of first row
    owner: torch.Tensor  # [rows, len(adapters)]: 1 where the row holds that adapter
    stacks: dict[nn.Module, _Stack | None]
    masks: dict[tuple[int, ...], torch.Tensor]


class AdapterBank:
    """The adapters loaded on one model, and the deltas of the batch being computed.

    ``add``, ``retire`` and the forward passes run on the scheduler's thread; ``acquire`` and
    ``release`` may run on any thread (a lock guards the names and counts)."""

    def __init__(self, model: nn.Module, max_loaded: int) -> None:
        self.model = model
        self.max_loaded = max_loaded
        self._by_name: dict[str, Adapter] = {}
        self._held: set[Adapter] = set()  # loaded, retired ones included until freed
        self._lock = threading.Lock()
        self._hooked: set[nn.Module] = set()
        self._single: Adapter | None = None  # every row of the batch holds this adapter
        self._mixed: _Mixed | None = None
        self._stacks: tuple[tuple[int, ...], dict] = ((), {})  # kept while the set is the same
        self._uids = itertools.count(1)

    # ----- names and lifetimes ---------------------------------------------------------------

    def read(self, name: str, path: str, pinned: bool = False) -> Adapter:
        """An adapter read and checked from ``path``, not yet in service (any thread)."""
        if not name:
            raise AdapterError("lora_name must not be empty")
        parameter = next(self.model.parameters())
        weights, rank = read_adapter(path, self.model, parameter.device, parameter.dtype)
        return Adapter(name, path, weights, rank, pinned, uid=next(self._uids))

    def add(self, adapter: Adapter) -> None:
        """Put a read adapter in service under its name (scheduler thread: hooks go in)."""
        with self._lock:
            if adapter.name in self._by_name:
                raise AdapterError(
                    f"Failed to load LoRA adapter {adapter.name} because it is already loaded"
                )
            if len(self._held) >= self.max_loaded:
                raise AdapterError(
                    f"Failed to load LoRA adapter {adapter.name}: {len(self._held)} adapters "
                    f"are loaded and max_loaded_loras is {self.max_loaded}; unload one first"
                )
            self._by_name[adapter.name] = adapter
            self._held.add(adapter)
        for module in adapter.weights:
            if module not in self._hooked:
                module.register_forward_hook(self._hook)
                self._hooked.add(module)

    def retire(self, name: str) -> Adapter:
        """Take ``name`` out of service now; its tensors go when no request holds it."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise AdapterError(
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self._by_name)}"
                )
            adapter.retired = True
            self._free_if_unused(adapter)
        return adapter

    def acquire(self, names: Sequence[str | None]) -> list[Adapter | None]:
        """The adapters of ``names`` (None: the base model), each held for one request; all or
        none: an unknown name raises and holds nothing."""
        with self._lock:
            unknown = [n for n in names if n is not None and n not in self._by_name]
            if unknown:
                raise AdapterError(
                    f"The following requested LoRA adapters are not loaded: {unknown[0]}\n"
                    f"Loaded adapters: {sorted(self._by_name)}."
                )
            adapters = [None if n is None else self._by_name[n] for n in names]
            for adapter in adapters:
                if adapter is not None:
                    adapter.users += 1
            return adapters

    def release(self, adapter: Adapter | None) -> None:
        """One request holding ``adapter`` has ended."""
        if adapter is None:
            return
        with self._lock:
            adapter.users -= 1
            self._free_if_unused(adapter)

    def _free_if_unused(self, adapter: Adapter) -> None:
        if adapter.retired and adapter.users == 0 and adapter in self._held:
            self._held.discard(adapter)
            adapter.weights = {}  # a batch computing with it holds it; nothing else does
            adapter.freed.set_result(None)

    def loaded(self) -> dict[str, Adapter]:
        """Adapters in service by name (retired ones, still finishing requests, left out)."""
        with self._lock:
            return dict(self._by_name)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    # ----- the deltas ------------------------------------------------------------------------

    @contextmanager
    def batch(self, adapters: Sequence[Adapter | None], device: torch.device) -> Iterator[None]:
        """Within it, forward passes add each row's adapter delta (row b: ``adapters[b]``)."""
        present = tuple({id(a): a for a in adapters if a is not None}.values())
        if len(present) == 1 and all(a is present[0] for a in adapters):
            self._single = present[0]
        elif present:
            self._mixed = self._mixed_batch(adapters, present, device)
        try:
            yield
        finally:
            self._single = self._mixed = None

    def _mixed_batch(
        self, adapters: Sequence[Adapter | None], present: tuple[Adapter, ...], device: torch.device
    ) -> _Mixed:
        key = tuple(a.uid for a in present)
        if self._stacks[0] != key:  # stacks are built per module as the forward reaches it
            self._stacks = (key, {})
        index = {id(a): k for k, a in enumerate(present)}
        owner = torch.zeros(len(adapters), len(present), dtype=self._dtype)
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                owner[row, index[id(adapter)]] = 1
        return _Mixed(present, owner.to(device), self._stacks[1], {})

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def active(self) -> bool:
        return self._single is not None or self._mixed is not None

    def add_deltas(self, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``module``'s output for input ``x``, rows first) plus each row's delta,
        in place."""
        if self._single is not None:
            weights = self._single.weights.get(module)
            if weights is not None:
                out.add_(_delta(x, weights), alpha=weights.scale)
        elif self._mixed is not None:
            self._add_mixed(self._mixed, module, x, out)

    def _add_mixed(
        self, mixed: _Mixed, module: nn.Module, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        if module not in mixed.stacks:
            mixed.stacks[module] = _stack(mixed.adapters, module)
        stack = mixed.stacks[module]
        if stack is None:  # no adapter of the batch targets it
            return
        mask = mixed.masks.get(stack.layout)
        if mask is None:  # [rows, sum r]: each column follows its adapter's owner column
            mask = mixed.masks[stack.layout] = mixed.owner.index_select(1, stack.columns)
        mask = mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
        out.add_(torch.nn.functional.linear(torch.nn.functional.linear(x, stack.a) * mask, stack.b))

    def add_fused(
        self, x: torch.Tensor, out: torch.Tensor, modules: Sequence[nn.Module], sizes: list[int]
    ) -> None:
        """``out`` is the fused output of ``modules`` (their outputs side by side, ``sizes``
        wide): each part gets its module's deltas."""
        for module, part in zip(modules, out.split(sizes, dim=-1), strict=True):
            self.add_deltas(module, x, part)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._single is not None or self._mixed is not None:
            self.add_deltas(module, args[0], output)


def _stack(adapters: tuple[Adapter, ...], module: nn.Module) -> _Stack | None:
    """The stacked weights of the adapters of ``adapters`` that target ``module``."""
    parts = [(k, a.weights[module]) for k, a in enumerate(adapters) if module in a.weights]
    if not parts:
        return None
    a = torch.cat([w.a for _, w in parts])
    layout = tuple(k for k, w in parts for _ in range(w.a.shape[0]))
    return _Stack(
        a=a,
        b=torch.cat([w.b * w.scale for _, w in parts], dim=1),
        layout=layout,
        columns=torch.tensor(layout, device=a.device),
    )


def _delta(x: torch.Tensor, weights: LoraWeights) -> torch.Tensor:
    return torch.nn.functional.linear(torch.nn.functional.linear(x, weights.a), weights.b)
