"""The store's Alembic migrations on a real SQLite file and a real PostgreSQL database: up to
head, down to base, up again; the tables they build match ``server.store.tables`` exactly; and
``proxrl db upgrade`` / ``proxrl db downgrade`` do the same from the command line.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import column, create_engine, inspect, table, text
from sqlalchemy import select as sa_select

from server.store.database import downgrade, sync_url, upgrade
from server.store.tables import Base
from tests.support import ROOT

TABLES = set(Base.metadata.tables)


def tables_in(url: str) -> set[str]:
    """The tables the database at ``url`` holds (Alembic's own bookkeeping included)."""
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


def current_revisions(url: str) -> list[str]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            return [
                row[0]
                for row in connection.execute(text("SELECT version_num FROM alembic_version"))
            ]
    finally:
        engine.dispose()


def drift(url: str) -> list:
    """What Alembic's autogenerate would change to make the database match the models."""
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def proxrl_db(*args: str) -> subprocess.CompletedProcess:
    """``proxrl db ...`` as a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "db", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database(request, tmp_path) -> str:
    """The URL of an empty database: a SQLite file that does not exist yet, or a fresh
    PostgreSQL database."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres").new_database()
    return f"sqlite:///{tmp_path / 'store' / 'proxrl.db'}"


def test_upgrade_downgrade_upgrade(empty_database):
    """Head builds every table; base removes them all; head builds them again."""
    url = empty_database
    upgrade(url)
    assert tables_in(url) == TABLES | {"alembic_version"}
    assert len(current_revisions(url)) == 1

    downgrade(url, "base")
    assert tables_in(url) - {"alembic_version"} == set()
    assert current_revisions(url) == []

    upgrade(url)
    assert tables_in(url) == TABLES | {"alembic_version"}


def test_upgrading_twice_is_a_no_op(empty_database):
    """Upgrading a database already at head changes nothing (the server does it at every
    start)."""
    url = empty_database
    upgrade(url)
    revisions = current_revisions(url)
    upgrade(url)
    assert current_revisions(url) == revisions
    assert tables_in(url) == TABLES | {"alembic_version"}


def test_migrations_match_the_models(empty_database):
    """A database migrated to head is what ``tables.py`` describes: autogenerate finds no
    difference (a new column or index without a migration fails here)."""
    upgrade(empty_database)
    assert drift(empty_database) == []


def test_default_rewards_stored_before_the_bound_are_clamped(empty_database):
    """Runs stored at 0002 with a default reward the server now refuses (1e200; NaN, which only
    SQLite's JSON could hold) validate after the upgrade, so their pages do not fail."""
    url = empty_database
    upgrade(url, "0002")
    stored = {"huge": 1e200, "small": -1e300, "fine": 0.5}
    if url.startswith("sqlite"):
        stored["nan"] = float("nan")
    engine = create_engine(sync_url(url))
    # the runs table as 0002 has it (today's has columns 0002 lacks)
    current = Base.metadata.tables["runs"].c
    at_0002 = ("id", "name", "model", "config", "policy_version", "api_key_hash", "is_default")
    runs = table("runs", *(column(name, current[name].type) for name in (*at_0002, "created_at")))
    try:
        with engine.begin() as connection:
            for name, value in stored.items():
                connection.execute(
                    runs.insert().values(
                        id=name,
                        name=name,
                        model="m",
                        config={"default_reward": value},
                        policy_version=0,
                        api_key_hash=name,
                        is_default=False,
                        created_at=datetime.now(UTC),
                    )
                )
        upgrade(url)
        with engine.connect() as connection:
            found = dict(connection.execute(sa_select(runs.c.id, runs.c.config)).all())
    finally:
        engine.dispose()
    want = {"huge": 1e9, "small": -1e9, "fine": 0.5, "nan": 0.0}
    assert {name: config["default_reward"] for name, config in found.items()} == {
        name: want[name] for name in stored
    }


def test_proxrl_db_upgrade_and_downgrade(tmp_path):
    """``proxrl db upgrade --db URL`` migrates to head, ``proxrl db downgrade --db URL`` back to
    base; each says what it did."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    upgraded = proxrl_db("upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "upgraded to head" in upgraded.stdout
    assert tables_in(url) == TABLES | {"alembic_version"}

    downgraded = proxrl_db("downgrade", "--db", url)
    assert downgraded.returncode == 0, downgraded.stderr
    assert "downgraded to base" in downgraded.stdout
    assert tables_in(url) - {"alembic_version"} == set()


def test_proxrl_db_refuses_an_unsupported_url():
    """A URL of a database proxrl does not support fails with a one-line message that names
    the flag, as every other invalid flag does, not a traceback.

    Fails today: the ValueError from ``database.sync_url`` escapes ``DbMigrate.cli_cmd``."""
    failed = proxrl_db("upgrade", "--db", "mysql://user@localhost/proxrl")
    assert failed.returncode == 2
    assert "unsupported database 'mysql'" in failed.stderr
    assert "db" in failed.stderr.splitlines()[0]
    assert "Traceback" not in failed.stderr
