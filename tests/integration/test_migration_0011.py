"""Migration 0011 (versions as names) on a store whose runs have published: each run past
version 0 gets its current version's row (path, kind), so a pin, a promotion or a rollback's
lineage finds it (before: 404 version_not_found for the version the run serves); a run at 0
gets none; and down again to 0010, the table gone, the runs intact."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.orm import Session as OrmSession

from server.store.database import downgrade, sync_url, upgrade
from server.store.tables import RunVersion
from tests.integration.test_migrations import empty_database  # noqa: F401  # the fixture

RUN = (
    "INSERT INTO runs (id, name, model, config, policy_version, weights_path, lora, "
    "api_key_hash, is_default, created_at) VALUES (:id, :id, 'm', '{}', :version, :path, :lora, "
    ":id, false, :now)"
)


def test_runs_that_published_keep_their_current_version_as_a_name(empty_database):  # noqa: F811
    url = empty_database
    upgrade(url, "0010")
    now = datetime.now(UTC)
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as connection:
            for id, version, path, lora in [
                ("full", 3, "/w/v3", False),
                ("adapters", 7, "/a/v7", True),
                ("fresh", 0, None, False),
            ]:
                connection.execute(
                    text(RUN),
                    {"id": id, "version": version, "path": path, "lora": lora, "now": now},
                )
        upgrade(url, "0011")
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT run_id, version, path, lora, parent, source, published_at "
                    "FROM run_versions ORDER BY run_id"
                )
            ).all()
        assert [tuple(row[:6]) for row in rows] == [
            ("adapters", 7, "/a/v7", True, None, None),
            ("full", 3, "/w/v3", False, None, None),
        ]
        with OrmSession(engine) as db:  # the rows read as the server reads them
            read = {row.run_id: row for row in db.scalars(select(RunVersion))}
        assert read["full"].published_at.tzinfo is not None
        assert abs((read["full"].published_at - now).total_seconds()) < 3600
        downgrade(url, "0010")
        assert "run_versions" not in inspect(engine).get_table_names()
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM runs")).scalar() == 3
    finally:
        engine.dispose()
