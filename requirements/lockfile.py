"""Read, finish and compare lock files written by pip-compile (``make lock``, ``make upgrade``).

``finish PATH`` puts the header on (naming the torch release the lock pins); drops the line
pip-compile writes for proxrl itself (``proxrl @ file:///its/checkout``: the extras name it;
``make venv`` installs it editable); drops local version labels (``torch==2.13.0+cpu`` becomes
``torch==2.13.0``: the same line then takes whichever CPU build of that release the machine's
index offers); and refuses a lock holding CUDA packages (``nvidia-*``, ``triton``, ``cuda-*``:
torch resolved to a multi-GB CUDA build). ``diff OLD NEW`` prints the versions that change.
:func:`pins` and :func:`normalized` are how the tests read a lock.
It knows nothing of how the lock was resolved.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
SELF = re.compile(r"^proxrl( @ |==)")
CUDA = re.compile(r"^(nvidia-|triton==|cuda-)", re.IGNORECASE)
LOCAL_LABEL = re.compile(r"^(\S+==[^\s+]+)\+\S+")


def header(torch: str) -> str:
    """The lock's header; ``torch`` is the release the lock pins."""
    return f"""\
# proxrl's lock: every dependency of `pip install -e '.[dev]'` (every role and optional extra
# but sglang, and the development tools), direct and transitive, pinned exactly.
# Platform: Linux x86_64, CPython 3.11 (CI and development); other platforms install by the
# bounds in pyproject.toml. torch is the CPU build, no nvidia-*/triton packages: `torch=={torch}`
# takes the CPU build of that release that the machine's index offers.
# Written by `make lock` (after a pyproject.toml change; keeps pins where possible) and
# `make upgrade` (the newest releases, tested first). Do not edit by hand.
"""


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """Package name (normalized) -> pinned version, of a lock's text."""
    lines = text.splitlines()
    return {normalized(m.group(1)): m.group(2) for m in map(PIN.match, lines) if m is not None}


def finish(path: Path) -> None:
    lines = path.read_text().splitlines()
    while lines and (not lines[0] or lines[0].startswith("#")):  # a header written before
        lines.pop(0)
    lines = [line for line in lines if not SELF.match(line)]
    cuda = [line.split()[0] for line in lines if CUDA.match(line)]
    if cuda:
        sys.exit(f"{path}: CUDA packages in the lock (torch resolved to a CUDA build): {cuda}")
    body = [LOCAL_LABEL.sub(r"\1", line) for line in lines]
    torch = pins("\n".join(body)).get("torch")
    if torch is None:
        sys.exit(f"{path}: the lock pins no torch")
    path.write_text(header(torch) + "\n".join(body) + "\n")


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
