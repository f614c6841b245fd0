"""Start ``proxrl engine``, ``proxrl serve`` (or another server) as a child process on loopback
and wait until it serves: the one child-process helper for every server the project starts.

Used by whatever needs a server of its own: the proxy its embedded engines when no --engines
are given, ``proxrl train`` its local ``proxrl serve``, the demo, benchmarks and tests. Imports
neither torch nor transformers: the servers run in the children.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, ClassVar, Self

import httpx

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when the thread that
    started it dies, even by SIGKILL, so a killed parent leaves no server, engine or trainer
    running. Linux only (None elsewhere); start such children from a thread that lives as long
    as they should."""
    if sys.platform != "linux":
        return None

    def arm() -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass

    return arm


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server run as a child process on loopback (it dies with us, see
    :func:`die_with_parent`), its output in ``log_path``, ``env`` added to its environment; a
    context manager that waits until ``url + ready_path`` answers 200 and stops it after
    (SIGTERM, then SIGKILL)."""

    name = "server"  # in error messages
    ready_path = "/health"
    ready_timeout = 120.0
    stop_timeout = 20.0  # after SIGTERM, before SIGKILL
    # Run it in a process group of its own and stop the whole group: for servers that start
    # processes of their own (SGLang's scheduler and detokenizer).
    own_process_group = False
    # Laid over our environment for the child: the servers we start for ourselves load their
    # model from disk, so they need no hub (a subclass whose child may download clears it).
    child_env: ClassVar[Mapping[str, str]] = {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # False: the child's stdout (what it shows a person at a terminal: keys, say) is dropped,
    # and the log takes its stderr only.
    log_stdout = True

    def __init__(
        self,
        command: list[str],
        url: str,
        log_path: str | Path | None = None,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.log_path = Path(log_path) if log_path else None
        self._log: IO[str] | None = open(self.log_path, "w") if self.log_path else None  # noqa: SIM115
        log = self._log if self._log else subprocess.DEVNULL
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **self.child_env, **(env or {})},
            stdout=log if self.log_stdout else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self.log_stdout else log,
            preexec_fn=die_with_parent(),
            start_new_session=self.own_process_group,
        )

    def ready(self) -> bool:
        """One probe: whether it serves now. Raises if the process has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}{self._tail()}")
        try:
            return httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float | None = None) -> Self:
        wait_all([self], timeout)
        return self

    def not_ready(self, timeout: float) -> TimeoutError:
        return TimeoutError(f"{self.name} not ready within {timeout:.0f}s{self._tail()}")

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return ":\n" + "\n".join(self.log_path.read_text().splitlines()[-30:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.own_process_group:  # whatever it started and left behind
            self._signal(signal.SIGKILL)
        if self._log is not None:
            self._log.close()

    def _signal(self, sig: signal.Signals) -> None:
        if not self.own_process_group:
            self.process.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def __enter__(self) -> Self:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_all(processes: Sequence[ServerProcess], timeout: float | None = None) -> None:
    """Wait until every one of ``processes`` serves, probing them all each round (one that
    exits is noticed at once, whichever it is); if one does not, stop them all and raise.
    ``timeout`` defaults to the longest of their own ready timeouts."""
    if timeout is None:
        timeout = max((process.ready_timeout for process in processes), default=0.0)
    deadline = time.monotonic() + timeout
    pending = list(processes)
    try:
        while pending:
            pending = [process for process in pending if not process.ready()]
            if pending and time.monotonic() >= deadline:
                raise pending[0].not_ready(timeout)
            if pending:
                time.sleep(0.2)
    except Exception:
        for process in processes:
            process.stop()
        raise


class EngineProcess(ServerProcess):
    """One ``proxrl engine`` process."""

    name = "engine"
    ready_path = "/model_info"

    def __init__(
        self,
        model_dir: str | Path,
        log_path: str | Path | None = None,
        *extra_args: str,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.port = port or free_port(host)
        command = [
            sys.executable, "-m", "server.cli", "engine",
            "--model", str(model_dir), "--host", host, "--port", str(self.port),
            "--log-level", "warning", *extra_args,
        ]  # fmt: skip
        super().__init__(command, f"http://{host}:{self.port}", log_path)


class ProxyProcess(ServerProcess):
    """One ``proxrl serve`` process: its own embedded engines unless ``--engines`` is among
    ``extra_args``, its store and checkpoints in ``data_dir``. The admin key travels in its
    environment (``PROXRL_ADMIN_KEY``), never on its command line; its stdout, meant for a
    person at a terminal, is dropped, and its log (stderr) goes to ``log_path``
    (``data_dir/server.log`` unless given)."""

    name = "proxy"
    ready_timeout = 300.0  # it starts its own engines first
    stop_timeout = 30.0  # and stops them first
    child_env: ClassVar[Mapping[str, str]] = {}  # its --model may be a hub id to download
    log_stdout = False

    def __init__(
        self,
        model_dir: str | Path,
        data_dir: str | Path,
        admin_key: str,
        *extra_args: str,
        log_path: str | Path | None = None,
        cwd: str | Path | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.data_dir = Path(data_dir)
        self.admin_key = admin_key
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
            "--port", str(self.port), "--data-dir", str(self.data_dir),
            "--log-level", "warning", *extra_args,
        ]  # fmt: skip
        super().__init__(
            command,
            f"http://127.0.0.1:{self.port}",
            log_path or self.data_dir / "server.log",
            cwd=cwd,
            env={"PROXRL_ADMIN_KEY": admin_key},
        )

    @property
    def admin(self) -> dict[str, str]:
        """Headers that carry the admin key."""
        return {"Authorization": f"Bearer {self.admin_key}"}
