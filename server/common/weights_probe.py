"""Can a reader see the trainer's weight files? A probe file answers it.

With ``publish.mode=disk`` the trainer writes each version under its ``output_dir/weights/``
and every engine loads it from that path, so the engines must see the trainer's disk at the same
path (a shared filesystem when they run on other machines). At start the trainer writes a probe
file there holding a random token; the server (``POST /admin/weights/probe``) reads it itself
and asks each engine to (the embedded engine's ``POST /weights_probe``). A reader that finds the
file with the token sees what the trainer writes; any other answer says why not.

Only a regular file named :data:`PROBE_NAME` is read (not through a symlink, not a FIFO or a
device), at most :data:`MAX_BYTES` of it, and only whether it holds the token is told: the route
cannot be used to read other files. A read is bounded by :data:`READ_WAIT_S` (a stale network
mount blocks ``open`` in the kernel): it runs in a thread of its own, not the event loop's shared
executor, and at most :data:`MAX_BLOCKED` such threads may be stuck at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading

PROBE_NAME = ".proxrl-weights-probe"
MAX_BYTES = 256
TOKEN_CHARS = 64
READ_WAIT_S = 10.0
MAX_BLOCKED = 4

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_blocked = threading.BoundedSemaphore(MAX_BLOCKED)


def name_problem(path: str) -> str | None:
    """Why ``path`` is not a probe's path (absolute, named :data:`PROBE_NAME`, a name the
    filesystem can take: no NUL, UTF-8), or None."""
    if "\x00" in path:
        return "a probe path holds no NUL character"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "a probe path is valid UTF-8 (it holds a lone surrogate)"
    if not os.path.isabs(path) or os.path.basename(path) != PROBE_NAME:
        return f"a probe path is absolute and its file is named {PROBE_NAME}"
    return None


def read_problem(path: str, token: str) -> str | None:
    """None when the file at ``path`` holds ``token``; else what this reader found instead.
    Unbounded: a stale mount blocks it (:func:`read_problem_within` bounds it)."""
    problem = name_problem(path)
    if problem is not None:
        return problem
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return f"{path} does not exist here"
    except OSError as exc:
        return f"{path} cannot be read here: {exc.strerror or exc}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{path} cannot be read here: it is not a regular file"
        found = os.read(fd, MAX_BYTES).decode(errors="replace").strip()
    except OSError as exc:
        return f"{path} cannot be read here: {exc.strerror or exc}"
    finally:
        os.close(fd)
    if found != token:
        return f"{path} holds another probe's token here (another file at the same path)"
    return None


async def read_problem_within(path: str, token: str, wait_s: float | None = None) -> str | None:
    """:func:`read_problem` in a thread of its own, answered within ``wait_s``: a read still
    blocked then is reported as such and left to finish (or not) in its thread (``wait_s``
    None: :data:`READ_WAIT_S`)."""
    wait_s = READ_WAIT_S if wait_s is None else wait_s
    if not _blocked.acquire(blocking=False):
        return f"{path} cannot be checked here now: {MAX_BLOCKED} earlier reads are still blocked"
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str | None] = loop.create_future()

    def settle(result: str | None, error: BaseException | None) -> None:
        if answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)

    def read() -> None:
        try:
            result, error = read_problem(path, token), None
        except BaseException as exc:  # handed to the waiter
            result, error = None, exc
        finally:
            _blocked.release()
        with contextlib.suppress(RuntimeError):  # the loop closed while this read was blocked
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=read, name="weights-probe-read", daemon=True).start()
    try:
        async with asyncio.timeout(wait_s):
            return await answer
    except TimeoutError:
        return f"{path} cannot be read here: the read did not finish within {wait_s:g} s"
