"""Stop a local Ray when the trainer that started it dies, however it dies, and remove its files.

``python trainer/watchdog.py MARKER DIR PID`` (PID: the trainer's) waits for end-of-file on its
stdin, a pipe whose write end only the trainer holds: the kernel closes it when the trainer
exits, SIGKILL included. (A child the trainer forked without exec would hold the pipe too, so
it also acts once it is no longer PID's child: the trainer died.) It then kills every process
whose environment holds ``MARKER`` (the trainer sets it before ``ray.init``, so every Ray
process inherits it: GCS, raylet, agents, workers) or that is a Ray program with a file under
``DIR`` open (Ray's temporary directory, where each Ray process writes its log; a user's
``tail -f`` on a log there is not Ray's and is left alone), and removes ``DIR``. It runs in a
session of its own, so a terminal's Ctrl-C or a signal to the trainer's process group does not
stop it before it has done its work.

It knows nothing about Ray beyond the marker, and imports nothing of ours: it starts in
milliseconds and works whatever state the trainer died in.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SWEEP_S = 10.0  # Ray may still be starting a worker while we kill: sweep until none is left
QUIET_ROUNDS = 5  # sweeps in a row that find nothing before we believe it (0.1 s apart)


def run_processes(marker: bytes, directory: str, spare: tuple[int, ...] = ()) -> list[int]:
    """The processes of the run: ``marker`` (``NAME=value``) in their initial environment, or
    a file under ``directory`` open (every Ray process writes its log there). Either alone has
    been seen to miss a process for a moment while Ray's own processes die. ``spare``: pids
    left out besides our own (the trainer, which may still hold a Ray log open)."""
    inside = directory.rstrip("/") + "/"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) in (os.getpid(), *spare):
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
                continue
        except OSError:
            pass  # ended meanwhile, not ours, or unreadable: the files may still tell
        with contextlib.suppress(OSError):
            if is_ray_program(proc, inside) and any(
                os.readlink(fd).startswith(inside) for fd in (proc / "fd").iterdir()
            ):
                found.append(int(proc.name))
    return found


def is_ray_program(proc: Path, inside: str) -> bool:
    """Whether the process runs Ray's code: a worker (``ray::...``) or a program under Ray's
    package (raylet, gcs_server, the agents). Arguments naming files under the run's directory
    do not count: ``tail -f DIR/logs/raylet.out`` is someone reading a log."""
    args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    return any(
        arg.startswith("ray::") or ("/ray/" in arg and not arg.startswith(inside)) for arg in args
    )


def kill_run(
    marker: bytes, directory: str, spare: tuple[int, ...], timeout_s: float = SWEEP_S
) -> int:
    """SIGKILL the run's processes until none is left; returns how many were killed."""
    killed: set[int] = set()
    quiet = 0
    deadline = time.monotonic() + timeout_s
    while quiet < QUIET_ROUNDS and time.monotonic() < deadline:
        pids = run_processes(marker, directory, spare)
        quiet = 0 if pids else quiet + 1
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.1)
    return len(killed)


def start(marker: str, directory: str) -> subprocess.Popen:
    """Start the watchdog; it acts when the returned process's stdin is closed (or we die)."""
    env = {k: v for k, v in os.environ.items() if f"{k}={v}" != marker}
    return subprocess.Popen(
        [sys.executable, "-I", __file__, marker, directory, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def main(marker: str, directory: str, trainer: int) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    # ``trainer`` (our parent, named by itself: it may be gone before we ask) may still hold a
    # Ray log open while it lives: never ours to kill.
    stdin = sys.stdin.buffer.fileno()
    while os.getppid() == trainer:  # once the trainer dies we are someone else's child
        readable, _, _ = select.select([stdin], [], [], 1.0)
        if readable and not os.read(stdin, 4096):
            break  # nothing is ever written: end-of-file is the message
    killed = kill_run(marker.encode(), directory, spare=(trainer,))
    shutil.rmtree(directory, ignore_errors=True)
    if killed:
        print(f"proxrl: stopped {killed} Ray process(es) left by the trainer", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
