"""Connecting to the store and migrating it.

Users give one SQLAlchemy URL (``sqlite:///path.db``, ``postgresql://user@host/db``); the
server talks to it through SQLAlchemy's asyncio layer (aiosqlite, psycopg) and Alembic migrates
it through the matching synchronous driver. SQLite runs in WAL mode, so readers never block the
writer and a crashed process loses nothing that was committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",  # in WAL mode: durable across process crashes
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=10000",
)


def default_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / 'proxrl.db').resolve()}"


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (None: another database, or SQLite in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(pragma)
    cursor.close()


def connect(url: str) -> AsyncEngine:
    local = make_url(url).get_backend_name() == "sqlite"  # a file: no connection to go stale
    engine = create_async_engine(async_url(url), pool_pre_ping=not local)
    if local:
        Path(make_url(url).database or "").parent.mkdir(parents=True, exist_ok=True)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def connect_sync(url: str) -> Engine:
    """A synchronous engine on the same database (for the turn writer's thread)."""
    engine = create_engine(
        sync_url(url), pool_pre_ping=make_url(url).get_backend_name() != "sqlite"
    )
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


# What the layers above the store hold to open a database session, and the session they pass
# back into it, naming no sqlalchemy type.
Sessionmaker = async_sessionmaker
Db = AsyncSession


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


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
