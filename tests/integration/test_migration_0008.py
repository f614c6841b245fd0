"""Migration 0008 (conversations) on a store that holds sessions: a session with turns reads as
one conversation (every turn in conversation 0, its breaks kept), a session without turns as
none; and down again to 0007, the columns gone, the sessions intact."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import create_engine, inspect, text

from server.store.database import downgrade, sync_url, upgrade
from tests.integration.test_migrations import empty_database  # noqa: F401  # the fixture

SESSION = (
    "INSERT INTO sessions (id, run_id, metadata, api_key_hash, status, created_at, "
    "last_activity_at, rewarded, turn_count, row_count, breaks) VALUES (:id, 'r', '{}', :id, "
    "'ended', :now, :now, false, :turns, :rows, :breaks)"
)


def test_sessions_from_before_read_as_one_conversation_each(empty_database):  # noqa: F811
    url = empty_database
    upgrade(url, "0007")
    now = datetime.now(UTC)
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO runs (id, name, model, config, policy_version, api_key_hash, "
                    "is_default, created_at) VALUES ('r', 'r', 'm', '{}', 0, 'r', false, :now)"
                ),
                {"now": now},
            )
            for id, turns, rows, breaks in [("busy", 3, 2, 1), ("idle", 0, 0, 0)]:
                connection.execute(
                    text(SESSION),
                    {"id": id, "now": now, "turns": turns, "rows": rows, "breaks": breaks},
                )
        upgrade(url, "0008")
        with engine.connect() as connection:
            found = connection.execute(
                text("SELECT id, conversations, breaks FROM sessions ORDER BY id")
            ).all()
            turn_columns = {c["name"] for c in inspect(connection).get_columns("turns")}
        assert [tuple(row) for row in found] == [("busy", 1, 1), ("idle", 0, 0)]
        assert "conversation" in turn_columns

        downgrade(url, "0007")
        with engine.connect() as connection:
            columns = {c["name"] for c in inspect(connection).get_columns("sessions")}
            turn_columns = {c["name"] for c in inspect(connection).get_columns("turns")}
            kept = connection.execute(text("SELECT id, breaks FROM sessions ORDER BY id")).all()
        assert "conversations" not in columns and "conversation" not in turn_columns
        assert [tuple(row) for row in kept] == [("busy", 1), ("idle", 0)]
    finally:
        engine.dispose()
