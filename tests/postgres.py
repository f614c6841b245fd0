"""A throwaway PostgreSQL server on 127.0.0.1 for the tests that run against Postgres.

It uses the machine's PostgreSQL binaries (Debian's ``postgresql`` package; ``make test``
installs it when missing), initialises a cluster in a temporary directory, and starts it on a
free port. As root, the server runs as the ``postgres`` user, since PostgreSQL refuses root.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from tests.support import free_port


def _binaries() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not candidates:
        raise RuntimeError(
            "PostgreSQL is not installed; `apt-get install -y postgresql` (make test does it)"
        )
    return Path(candidates[-1]).parent


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class PostgresServer:
    """``host``: the address it listens on (loopback by default; another one also trusts its
    subnet, for the multi-host drills); ``wrap``: a prefix for its commands, e.g. ``ip netns
    exec NAME`` to run it in a network namespace."""

    def __init__(self, host: str = "127.0.0.1", wrap: Sequence[str] = ()) -> None:
        self.bin = _binaries()
        # Not under pytest's tmp_path: its parents are private to root, and as root the server
        # runs as the postgres user, which must reach its directory.
        self.root = Path(tempfile.mkdtemp(prefix="proxrl-postgres-"))
        self.data = self.root / "data"
        self.host = host
        self.wrap = list(wrap)
        self.port = free_port()
        self.url = f"postgresql://postgres@{host}:{self.port}"

    def _run(self, *args: str) -> None:
        command = [*self.wrap, *_as_server_user(list(args))]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust")
        if self.host != "127.0.0.1":
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write("host all all samenet trust\n")
        self.resume()
        return self

    def resume(self) -> None:
        """Start the server again (after ``halt``), on the same port and data."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses={self.host} -c fsync=off"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "server.log"), "-w", "start",
        )  # fmt: skip

    def halt(self) -> None:
        """Stop the server as an operator would (fast: connections cut, transactions rolled
        back), keeping its data."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        try:
            self.halt()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        import psycopg

        name = f"proxrl_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"{self.url}/postgres", autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return f"{self.url}/{name}"
