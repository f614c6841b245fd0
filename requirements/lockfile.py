"""Finish and compare lock files written by pip-compile (``make lock``, ``make upgrade``).

``finish PATH`` puts the header on; drops the line pip-compile writes for proxrl itself
(``proxrl @ file:///its/checkout``: the extras name it; ``make venv`` installs it editable);
drops local version labels (``torch==2.13.0+cpu`` becomes ``torch==2.13.0``: the same line
then takes whichever CPU build of that release the machine's index offers); and refuses a lock
holding CUDA packages (``nvidia-*``, ``triton``, ``cuda-*``: torch resolved to a multi-GB CUDA
build). ``diff OLD NEW`` prints the versions that change.
It knows nothing of how the lock was resolved.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADER = """\
# proxrl's lock: every dependency of `pip install -e '.[dev]'` (every role and optional extra
# but sglang, and the development tools), direct and transitive, pinned exactly.
# Platform: Linux x86_64, CPython 3.11 (CI and development); other platforms install by the
# bounds in pyproject.toml. torch is the CPU build, no nvidia-*/triton packages: `torch==2.13.0`
# takes the CPU wheel the machine's index offers (here /opt/wheels' 2.13.0+cpu).
# Written by `make lock` (after a pyproject.toml change; keeps pins where possible) and
# `make upgrade` (the newest releases, tested first). Do not edit by hand.
"""
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
SELF = re.compile(r"^proxrl( @ |==)")
CUDA = re.compile(r"^(nvidia-|triton==|cuda-)", re.IGNORECASE)


def pins(text: str) -> dict[str, str]:
    """Package name (lowercase) -> pinned version."""
    return {
        m.group(1).lower(): m.group(2) for m in map(PIN.match, text.splitlines()) if m is not None
    }


def finish(path: Path) -> None:
    lines = [
        line
        for line in path.read_text().splitlines()
        if line not in HEADER.splitlines() and not SELF.match(line)
    ]
    cuda = [line.split()[0] for line in lines if CUDA.match(line)]
    if cuda:
        sys.exit(f"{path}: CUDA packages in the lock (torch resolved to a CUDA build): {cuda}")
    body = [re.sub(r"^(\S+==[^\s+]+)\+\S+", r"\1", line) for line in lines]
    path.write_text(HEADER + "\n".join(body).lstrip("\n") + "\n")


def diff(old: Path, new: Path) -> None:
    before, after = pins(old.read_text()), pins(new.read_text())
    changes = [
        f"  {name}: {before.get(name, '-')} -> {after.get(name, '-')}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    ]
    print(f"{new} against {old}: {len(changes)} change(s)", *changes, sep="\n")


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["finish", path]:
            finish(Path(path))
        case ["diff", old, new]:
            diff(Path(old), Path(new))
        case _:
            sys.exit("usage: lockfile.py finish LOCK | diff OLD_LOCK NEW_LOCK")
