"""How a key proxrl makes up reaches the person who started it: on the terminal, never in a log.

A service manager (systemd, supervisord, docker) keeps a process's stdout in its journal, which
more people can read than the key should reach. So a key is printed only where stdout is a
terminal; anywhere else it is written to a file only its owner can read (mode 0600) and the
line printed names that file instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def hand_over(line: str, key: str, file: Path) -> None:
    """Print ``line`` with ``key`` where stdout is a terminal; otherwise write ``key`` to
    ``file`` (mode 0600, replacing an older one) and print ``line`` naming the file."""
    if sys.stdout.isatty():
        print(f"{line}: {key}", flush=True)
        return
    write_private(file, key + "\n")
    print(f"{line}: written to {file} (mode 0600; stdout is not a terminal)", flush=True)


def write_private(file: Path, text: str) -> None:
    """``text`` into ``file``, readable by its owner alone from its first byte (a file already
    there is emptied and its mode narrowed before anything is written)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as out:
        os.fchmod(descriptor, 0o600)
        out.write(text)
