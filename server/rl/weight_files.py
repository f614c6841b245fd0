"""A checkpoint's safetensors files, read and checked before any engine pauses for them.

A publish pauses every engine, so weights an engine cannot read (a name that is a FIFO or a
device, a truncated file, a hung network mount) must be found before that, not by the engines
while every client waits. The same files the engines will load (``model.safetensors.index.json``'s
shards, or every ``*.safetensors``) are each checked to be a regular file whose header says how
long it is, and is that long. The reading happens in a thread of its own, with a deadline: a
read that never returns leaves that thread behind (a daemon), never the event loop or a pool.

A path this machine does not have is not judged: engines on other machines may have it.
It knows nothing of engines or HTTP; the tensors themselves are read by the engines alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

HEADER_MAX_BYTES = 100 * 2**20  # safetensors' own bound on its JSON header


def problem_of(model_path: str) -> str | None:
    """What stops the checkpoint at ``model_path`` from loading, or None (also where this
    machine has no such path). Blocks while the files do."""
    root = Path(model_path)
    if not root.exists():
        return None
    if not root.is_dir():
        return f"{model_path!r} is not a directory"
    index = root / "model.safetensors.index.json"
    if index.exists():
        if not stat.S_ISREG(os.stat(index).st_mode):
            return f"{index.name} is not a regular file"
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index.name} is not a safetensors index ({exc!r})"
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        return f"no *.safetensors files in {model_path!r}"
    for name in names:
        problem = _file_problem(root / name)
        if problem is not None:
            return f"{name}: {problem}"
    return None


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 2**20


def adapter_problem_of(adapter_path: str) -> str | None:
    """What stops the LoRA adapter at ``adapter_path`` (peft's save_pretrained layout:
    adapter_config.json and adapter_model.safetensors) from loading, or None (also where this
    machine has no such path). Blocks while the files do."""
    root = Path(adapter_path)
    if not root.exists():
        return None
    if not root.is_dir():
        return f"{adapter_path!r} is not a directory"
    config_path = root / ADAPTER_CONFIG
    if not config_path.exists():
        return f"no {ADAPTER_CONFIG} in {adapter_path!r} (is it full weights? send model_path)"
    try:
        if not stat.S_ISREG(os.stat(config_path).st_mode):
            return f"{ADAPTER_CONFIG} is not a regular file"
        with open(config_path, "rb") as file:
            data = file.read(CONFIG_MAX_BYTES + 1)
        if len(data) > CONFIG_MAX_BYTES:
            return f"{ADAPTER_CONFIG} is over {CONFIG_MAX_BYTES:,} bytes"
        config = json.loads(data)
    except OSError as exc:
        return f"{ADAPTER_CONFIG} cannot be read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{ADAPTER_CONFIG} is not JSON ({exc})"
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return f'{ADAPTER_CONFIG} is not a LoRA adapter\'s config (peft_type is not "LORA")'
    if not (root / ADAPTER_WEIGHTS).exists():
        return f"no {ADAPTER_WEIGHTS} in {adapter_path!r}"
    weights = _file_problem(root / ADAPTER_WEIGHTS)
    return None if weights is None else f"{ADAPTER_WEIGHTS}: {weights}"


def _file_problem(path: Path) -> str | None:
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            return "not a regular file"  # a FIFO or a device would block or never end
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                return f"{size} bytes: too short for a safetensors header"
            (header_bytes,) = struct.unpack("<Q", file.read(8))
            if header_bytes > min(HEADER_MAX_BYTES, size - 8):
                return f"its header claims {header_bytes} bytes of a {size}-byte file"
            header = json.loads(file.read(header_bytes))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError) as exc:
        return f"its header is not JSON ({exc})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + header_bytes + max(ends, default=0)
    if expected != size:
        return f"{size} bytes where its header describes {expected} (truncated or overwritten)"
    return None


async def within(seconds: float, work: Callable[[], str | None], what: str) -> str | None:
    """``work()``'s answer, run in a daemon thread; if it has not answered within ``seconds``,
    why not (the thread is left to finish, or not, on its own)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str | None] = loop.create_future()

    def run() -> None:
        try:
            result: str | None = work()
        except Exception as exc:  # reported to the caller, whatever it is
            result = f"{exc!r}"
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result)

    def settle(result: str | None) -> None:
        if not answer.done():  # given up on: nobody reads it
            answer.set_result(result)

    threading.Thread(target=run, name="proxrl-weight-check", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(answer), seconds)
    except TimeoutError:
        return f"{what} did not finish within {seconds:g} s (a hung mount, or a FIFO?)"


async def problem(model_path: str, seconds: float) -> str | None:
    """``problem_of(model_path)``, given at most ``seconds``."""
    return await within(seconds, lambda: problem_of(model_path), "reading the weight files")


async def adapter_problem(adapter_path: str, seconds: float) -> str | None:
    """``adapter_problem_of(adapter_path)``, given at most ``seconds``."""
    return await within(
        seconds, lambda: adapter_problem_of(adapter_path), "reading the adapter's files"
    )


def size_of(path: str) -> int | None:
    """The bytes of the regular files directly in the directory ``path`` (a checkpoint's or an
    adapter's), or None where this machine has no such directory. Blocks while the files do."""
    root = Path(path)
    if not root.is_dir():
        return None
    return sum(entry.stat().st_size for entry in root.iterdir() if entry.is_file())


async def size(path: str | None) -> int | None:
    """``size_of(path)``, off the event loop (a publish's files, already checked readable)."""
    return None if path is None else await asyncio.to_thread(size_of, path)
