"""Can a reader see the trainer's weight files? A probe file answers it.

With ``publish.mode=disk`` the trainer writes each version under its ``output_dir/weights/``
and every engine loads it from that path, so the engines must see the trainer's disk at the same
path (a shared filesystem when they run on other machines). At start the trainer writes a probe
file there holding a random token; the server (``POST /admin/weights/probe``) reads it itself
and asks each engine to (the embedded engine's ``POST /weights_probe``). A reader that finds the
file with the token sees what the trainer writes; any other answer says why not.

Only a file named :data:`PROBE_NAME` is read, at most :data:`MAX_BYTES` of it, and only whether
it holds the token is told: the route cannot be used to read other files.
"""

from __future__ import annotations

import os

PROBE_NAME = ".proxrl-weights-probe"
MAX_BYTES = 256
TOKEN_CHARS = 64


def name_problem(path: str) -> str | None:
    """Why ``path`` is not a probe's path (absolute, named :data:`PROBE_NAME`), or None."""
    if not os.path.isabs(path) or os.path.basename(path) != PROBE_NAME:
        return f"a probe path is absolute and its file is named {PROBE_NAME}"
    return None


def read_problem(path: str, token: str) -> str | None:
    """None when the file at ``path`` holds ``token``; else what this reader found instead."""
    problem = name_problem(path)
    if problem is not None:
        return problem
    try:
        with open(path, "rb") as f:
            found = f.read(MAX_BYTES).decode(errors="replace").strip()
    except FileNotFoundError:
        return f"{path} does not exist here"
    except OSError as exc:
        return f"{path} cannot be read here: {exc.strerror or exc}"
    if found != token:
        return f"{path} holds another probe's token here (another file at the same path)"
    return None
