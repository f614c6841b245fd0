"""Stop a local Ray when the trainer that started it dies, however it dies, and remove its files.

``python trainer/watchdog.py MARKER DIR`` waits for end-of-file on its stdin, a pipe whose write
end only the trainer holds: the kernel closes it when the trainer exits, SIGKILL included. It
then kills every process whose environment holds ``MARKER`` (the trainer sets it before
``ray.init``, so every Ray process inherits it: GCS, raylet, agents, workers) and removes
``DIR``. It runs in a session of its own, so a terminal's Ctrl-C or a signal to the trainer's
process group does not stop it before it has done its work.

It knows nothing about Ray beyond the marker, and imports nothing of ours: it starts in
milliseconds and works whatever state the trainer died in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SWEEP_S = 10.0  # Ray may still be starting a worker while we kill: sweep until none is left


def marked_processes(marker: bytes) -> list[int]:
    """The processes whose initial environment holds ``marker`` (``NAME=value``)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile, or not ours
        if marker in entries:
            found.append(int(environ.parent.name))
    return found


def kill_marked(marker: bytes, timeout_s: float = SWEEP_S) -> int:
    """SIGKILL every marked process until none is left; returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while (pids := [p for p in marked_processes(marker) if p != os.getpid()]) and (
        time.monotonic() < deadline
    ):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    return len(killed)


def start(marker: str, directory: str) -> subprocess.Popen:
    """Start the watchdog; it acts when the returned process's stdin is closed (or we die)."""
    env = {k: v for k, v in os.environ.items() if f"{k}={v}" != marker}
    return subprocess.Popen(
        [sys.executable, "-I", __file__, marker, directory],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def main(marker: str, directory: str) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass  # nothing is ever written: end-of-file is the message
    kill_marked(marker.encode())
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
