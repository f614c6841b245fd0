"""SGLang servers started by ``proxrl serve --engine sglang``: the command each one runs, and the
processes.

Each server is ``python -m sglang.launch_server`` on loopback with the flags proxrl relies on
(docs/architecture/sglang-protocol.md): the model, a free port, its tensor-parallel size and
first GPU, and the weight version proxrl counts from (``--weight-version 0``; the proxy reads
versions back from ``/model_info`` and ``meta_info.weight_version``); then the user's
``--sglang-args``. Where LoRA runs share the engines, ``lora`` adds SGLang's multi-LoRA flags
(``lora_args``: ``--enable-lora``, the adapter memory pool's rank and target modules, which SGLang
needs at start when no adapter is given then, and the bounds on adapters held and batched), and
those flags may then not be set again in ``--sglang-args``. They are supervised as the embedded
engines are: each must answer ``/health`` within ``--sglang-start-timeout-s``, dies with the
proxy (and takes its own scheduler processes with it), and leaves the rotation while the pool's
health checks fail. Nothing here imports SGLang.
"""

from __future__ import annotations

import importlib.util
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from server.common.processes import ServerProcess, free_port, wait_all

log = logging.getLogger(__name__)


class SGLangSettings(Protocol):
    """What starting SGLang servers needs (``proxrl serve``'s settings have it)."""

    @property
    def model(self) -> str: ...
    @property
    def sglang_module(self) -> str: ...
    @property
    def sglang_args(self) -> str: ...
    @property
    def sglang_tp_size(self) -> int: ...
    @property
    def num_engines(self) -> int: ...
    @property
    def data_dir(self) -> Path: ...
    @property
    def sglang_start_timeout_s(self) -> float: ...


HOST = "127.0.0.1"
FIRST_WEIGHT_VERSION = "0"
INSTALL = 'pip install "sglang[all]"'

# Flags proxrl sets itself, and where to set what they control instead.
MANAGED_FLAGS = {
    "--model-path": "--model",
    "--model": "--model",
    "--host": "proxrl (engines listen on loopback)",
    "--port": "proxrl (a free port each)",
    "--tp-size": "--sglang-tp-size",
    "--tp": "--sglang-tp-size",
    "--tensor-parallel-size": "--sglang-tp-size",
    "--dp-size": "--num-engines (one data-parallel rank per server)",
    "--dp": "--num-engines (one data-parallel rank per server)",
    "--data-parallel-size": "--num-engines (one data-parallel rank per server)",
    "--pp-size": "nothing: proxrl's weight group takes one pipeline rank per server",
    "--pp": "nothing: proxrl's weight group takes one pipeline rank per server",
    "--pipeline-parallel-size": "nothing: proxrl's weight group takes one pipeline rank per server",
    "--base-gpu-id": "--sglang-tp-size (server i starts at GPU i * tp size)",
    "--weight-version": "proxrl (versions count from 0)",
}


@dataclass(frozen=True)
class LoRALimits:
    """What an SGLang server is started with to serve LoRA adapters loaded at run time
    (docs/architecture/sglang-protocol.md, "LoRA adapters")."""

    max_rank: int  # the largest adapter rank it can hold (its memory pool is sized for it)
    target_modules: tuple[str, ...]  # module-name suffixes (q_proj, ...) any adapter may target
    max_loaded: int  # adapters held at once; past it SGLang unloads its least recently used
    max_per_batch: int  # distinct adapters in one batch (GPU slots)

    def __post_init__(self) -> None:
        if self.max_rank < 1 or not self.target_modules or self.max_per_batch < 1:
            raise ValueError("SGLang's LoRA pool needs a rank, target modules and a batch size")
        if self.max_loaded < self.max_per_batch:  # SGLang refuses to start otherwise
            raise ValueError(
                f"max_loaded ({self.max_loaded}) must be at least max_per_batch "
                f"({self.max_per_batch}): SGLang does not start otherwise"
            )


LORA_FLAGS = (
    "--enable-lora",
    "--max-lora-rank",
    "--lora-target-modules",
    "--max-loaded-loras",
    "--max-loras-per-batch",
)


def lora_args(limits: LoRALimits) -> list[str]:
    """SGLang's flags for serving adapters within ``limits``."""
    return [
        "--enable-lora",
        "--max-lora-rank", str(limits.max_rank),
        "--lora-target-modules", *limits.target_modules,
        "--max-loaded-loras", str(limits.max_loaded),
        "--max-loras-per-batch", str(limits.max_per_batch),
    ]  # fmt: skip


def split_args(text: str) -> list[str]:
    """``--sglang-args`` as SGLang's argv; refuses what proxrl sets itself."""
    try:
        args = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--sglang-args cannot be split as a shell would: {exc}") from None
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise ValueError(f"--sglang-args sets {flag}; that is set by {MANAGED_FLAGS[flag]}")
    return args


def missing(module: str) -> str | None:
    """Why ``module`` cannot be run (its package is not installed here), or None."""
    package = module.partition(".")[0]
    if importlib.util.find_spec(package) is not None:
        return None
    return (
        f"--engine sglang: the package {package!r} (for python -m {module}) is not installed in "
        f"this Python ({sys.executable}). Install SGLang on a machine with CUDA: {INSTALL} "
        "(or, in a clone of proxrl, pip install -e '.[sglang]'); or start SGLang yourself and "
        "attach to it with --engines URL."
    )


def command(
    settings: SGLangSettings, index: int, port: int, lora: LoRALimits | None = None
) -> list[str]:
    """The command line of SGLang server ``index`` (0-based) of ``settings`` (serving adapters
    within ``lora``, if given)."""
    tp_size = settings.sglang_tp_size
    user_args = split_args(settings.sglang_args)
    extra = [] if lora is None else lora_args(lora)
    for arg in user_args if lora is not None else []:
        if arg.split("=", 1)[0] in LORA_FLAGS:
            raise ValueError(
                f"--sglang-args sets {arg.split('=', 1)[0]}; proxrl sets it for LoRA runs"
            )
    return [
        sys.executable, "-m", settings.sglang_module,
        "--model-path", settings.model,
        "--host", HOST,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--base-gpu-id", str(index * tp_size),
        "--weight-version", FIRST_WEIGHT_VERSION,
        *extra,
        *user_args,
    ]  # fmt: skip


class SGLangProcess(ServerProcess):
    """One SGLang server (``command``), in a process group of its own."""

    name = "sglang"
    ready_path = "/health"  # 503 until the model is loaded (docs/architecture/sglang-protocol.md)
    own_process_group = True


def launch(settings: SGLangSettings, lora: LoRALimits | None = None) -> list[SGLangProcess]:
    """Start ``--num-engines`` SGLang servers (serving adapters within ``lora``, if given) and
    wait until each serves."""
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = []
    for index in range(settings.num_engines):
        port = free_port(HOST)
        argv = command(settings, index, port, lora)
        log.info("starting SGLang: %s", shlex.join(argv))
        servers.append(SGLangProcess(argv, f"http://{HOST}:{port}", logs / f"sglang-{index}.log"))
    wait_all(servers, settings.sglang_start_timeout_s)
    log.info("started %d SGLang server(s): %s", len(servers), [s.url for s in servers])
    return servers
