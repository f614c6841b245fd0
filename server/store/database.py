"""Connecting to the store and migrating it.

Users give one SQLAlchemy URL (``sqlite:///path.db``, ``postgresql://user@host/db``); the
server talks to it through SQLAlchemy's asyncio layer (aiosqlite, psycopg) and Alembic migrates
it through the matching synchronous driver. SQLite runs in WAL mode, so readers never block the
writer and a crashed process loses nothing that was committed.

A store that cannot take a request now (its disk full, its file read-only, locked past the busy
timeout, a Postgres that went away) is a *fault*, not a bug: ``store_fault`` tells one from the
driver's error, and on the server's engines (``connect(url, health)``) the error is raised as
``StoreUnavailable`` (503 with Retry-After) and ``StoreHealth`` logs the episode once when it
begins and once when a write commits again. Nothing here retries: the client does.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

from server.errors import StoreUnavailable

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",  # in WAL mode: durable across process crashes
    "PRAGMA foreign_keys=ON",
)
BUSY_TIMEOUT_S = 10.0  # how long a SQLite write waits for a lock another connection holds
# SQLite's primary result codes that mean "not now" rather than "wrong statement".
_SQLITE_FAULTS = {
    5: "locked by another connection (busy)",
    6: "locked",
    8: "read-only",
    10: "failing to read or write its file (I/O error)",
    13: "full (no space left on its disk)",
    14: "unable to open its file",
}


def default_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / 'proxrl.db').resolve()}"


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (None: another database, or SQLite in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def is_shared(url: str) -> bool:
    """A store that several servers may share (PostgreSQL); SQLite is one server's."""
    return make_url(url).get_backend_name() == "postgresql"


class StoreInUse(RuntimeError):
    """Another ``proxrl serve`` serves this SQLite store."""


class SingleServer:
    """The claim of one serving process on a SQLite store: an exclusive ``flock`` on a file
    beside it (``<store>.serving``), held while the process serves, released by the kernel when
    it exits however it ends. SQLite is one process's store: admission, retries and the engines'
    weights are each decided in one process. Replicas share a PostgreSQL store instead, which
    needs no claim. ``proxrl export`` and other readers do not claim."""

    def __init__(self, url: str) -> None:
        self.store = sqlite_file(url)
        self._file: Any = None

    @property
    def path(self) -> Path | None:
        return None if self.store is None else self.store.with_name(self.store.name + ".serving")

    def acquire(self) -> None:
        """Claim the store (nothing for PostgreSQL or SQLite in memory); ``StoreInUse`` when
        another process holds it."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        claim = open(self.path, "a+")  # noqa: SIM115 (held open for the claim's life)
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            claim.seek(0)
            holder = claim.read().strip() or "unknown"
            claim.close()
            raise StoreInUse(
                f"the SQLite store {self.store} is served by another proxrl process (pid "
                f"{holder}); SQLite is one process's store: run replicas over PostgreSQL "
                "(--db postgresql://...), or give this server its own --db"
            ) from None
        claim.truncate(0)
        claim.write(str(os.getpid()))
        claim.flush()
        self._file = claim

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # the flock goes with it
            self._file = None

    def problem(self) -> str | None:
        """Why this process could not claim the store now (None: it could), creating nothing
        and keeping no claim."""
        if self.path is None or not self.path.exists():
            return None  # never served, or by nobody who claimed it
        try:
            self.acquire()
        except StoreInUse as exc:
            return str(exc)
        self.release()
        return None


def _with_driver(url: str, sqlite: str, postgres: str) -> str:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername=sqlite).render_as_string(hide_password=False)
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername=postgres).render_as_string(hide_password=False)
    raise ValueError(f"unsupported database {backend!r}: use sqlite:// or postgresql://")


def async_url(url: str) -> str:
    return _with_driver(url, "sqlite+aiosqlite", "postgresql+psycopg")


def sync_url(url: str) -> str:
    return _with_driver(url, "sqlite", "postgresql+psycopg")


def url_problem(url: str) -> str | None:
    """Why the store cannot use ``url``, in a few words (None: it can)."""
    try:
        sync_url(url)
    except ArgumentError:
        return "not a database URL (e.g. sqlite:///data/proxrl.db or postgresql://...)"
    except ValueError as exc:
        return str(exc)
    return None


def store_fault(exc: BaseException) -> str | None:
    """Why the store cannot take requests now, if ``exc`` says so (a few words: "full (no space
    left on its disk)", "unreachable: ..."); None for any other error (a bug, a constraint)."""
    if isinstance(exc, StoreUnavailable):
        return exc.reason
    if isinstance(exc, PoolTimeout):
        return "out of connections (every pooled connection is busy)"
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return "unreachable: the connection was lost"
    driver_error = (exc.orig if isinstance(exc, DBAPIError) else None) or exc
    if isinstance(driver_error, sqlite3.Error):
        code = getattr(driver_error, "sqlite_errorcode", None)
        return None if code is None else _SQLITE_FAULTS.get(code & 0xFF)
    psycopg = sys.modules.get("psycopg")  # loaded if the error is one of its own
    if psycopg is not None and isinstance(
        driver_error, psycopg.OperationalError | psycopg.InterfaceError
    ):
        return f"unreachable: {first_line(driver_error)}"
    if isinstance(exc, OperationalError | InterfaceError):  # another driver's
        return f"unreachable: {first_line(driver_error)}"
    return None


def first_line(exc: BaseException) -> str:
    """An error's first line, at most 200 characters (for one-line logs and answers)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class StoreHealth:
    """Whether the store takes writes, told by the requests themselves: a fault begins an
    *episode* (logged once, with its reason); a write that commits ``settle_s`` after the last
    fault ends it (logged once, with its length). A store that fails on and off (a full disk
    that still has room for some pages) is one episode, not one per flip; in between, requests
    fail with 503 and nothing more is logged."""

    def __init__(self, settle_s: float = 2.0) -> None:
        self.settle_s = settle_s
        self.down_since: float | None = None  # time.time() of the episode's first fault
        self.last_fault = 0.0
        self.reason = ""
        self.faults = 0  # failures in the episode
        # Told from the event loop and from the turn writer's thread: one episode, logged once.
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.down_since is None

    def failed(self, reason: str) -> None:
        with self._lock:
            self.faults += 1
            self.last_fault = time.time()
            if self.down_since is not None:
                return
            self.down_since, self.reason, self.faults = self.last_fault, reason, 1
        log.warning("store unavailable: %s; requests that need it answer 503", reason)

    def recovered(self) -> None:
        """A write committed."""
        with self._lock:
            if self.down_since is None or time.time() - self.last_fault < self.settle_s:
                return
            took, self.down_since = self.last_fault - self.down_since, None
        log.warning(
            "store available again after %.1f s (%s; %d failures meanwhile)",
            took,
            self.reason,
            self.faults,
        )

    def raise_faults(self, context: ExceptionContext) -> None:
        """SQLAlchemy's ``handle_error``: a fault raised as ``StoreUnavailable``, the rest as
        they are."""
        reason = store_fault(context.original_exception)
        if reason is None and context.sqlalchemy_exception is not None:
            reason = store_fault(context.sqlalchemy_exception)
        if reason is None and context.is_disconnect:
            reason = "unreachable: the connection was lost"
        if reason is not None:
            self.failed(reason)
            raise StoreUnavailable(reason) from context.original_exception


def _sqlite_pragmas(busy_timeout_s: float):
    def apply(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        for pragma in SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cursor.close()

    return apply


def connect(
    url: str, health: StoreHealth | None = None, busy_timeout_s: float = BUSY_TIMEOUT_S
) -> AsyncEngine:
    """``health``: the server's, whose engines raise faults as ``StoreUnavailable``."""
    local = make_url(url).get_backend_name() == "sqlite"  # a file: no connection to go stale
    engine = create_async_engine(async_url(url), pool_pre_ping=not local)
    if local:
        Path(make_url(url).database or "").parent.mkdir(parents=True, exist_ok=True)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas(busy_timeout_s))
    if health is not None:
        event.listen(engine.sync_engine, "handle_error", health.raise_faults)
    return engine


def connect_sync(
    url: str, health: StoreHealth | None = None, busy_timeout_s: float = BUSY_TIMEOUT_S
) -> Engine:
    """A synchronous engine on the same database (for the turn writer's thread)."""
    engine = create_engine(
        sync_url(url), pool_pre_ping=make_url(url).get_backend_name() != "sqlite"
    )
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas(busy_timeout_s))
    if health is not None:
        event.listen(engine, "handle_error", health.raise_faults)
    return engine


# What the layers above the store hold to open a database session, and the session they pass
# back into it, naming no sqlalchemy type.
Sessionmaker = async_sessionmaker
Db = AsyncSession


def sessionmaker(engine: AsyncEngine, health: StoreHealth | None = None) -> async_sessionmaker:
    """``health``: told when a session commits (the end of a fault's episode)."""
    if health is None:
        return async_sessionmaker(engine, expire_on_commit=False)
    committing = type("CommitsTold", (Session,), {})
    event.listen(committing, "after_commit", lambda _session: health.recovered())
    return async_sessionmaker(engine, expire_on_commit=False, sync_session_class=committing)


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (blocking; creates SQLite files)."""
    if make_url(url).get_backend_name() == "sqlite":
        Path(make_url(url).database or "").parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def revision_mismatch(url: str) -> str | None:
    """None when the database at ``url`` is at this code's migration head; else what it is at
    and what the code expects (for a command that reads a store without upgrading it)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    engine = connect_sync(url)
    try:
        with engine.connect() as connection:
            current = set(MigrationContext.configure(connection).get_current_heads())
    finally:
        engine.dispose()
    if current == heads:
        return None
    return f"at revision {', '.join(sorted(current)) or 'none'}, not {', '.join(sorted(heads))}"
