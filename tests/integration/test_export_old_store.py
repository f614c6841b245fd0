"""``proxrl export`` on a store an older proxrl left (its migrations behind the code's): a
one-line message naming ``proxrl db upgrade``, never a traceback from a missing column, and no
file written. The server upgrades its store when it starts; the export command reads the store
without a server, so it must say so itself."""

from __future__ import annotations

import asyncio

import pytest

from server.cli import main as proxrl
from server.store import database, runs


def _run_in(url: str) -> str:
    async def create() -> str:
        engine = database.connect(url)
        try:
            async with database.sessionmaker(engine)() as db, db.begin():
                run, _ = await runs.create_run(db, "old", "tiny", {})
                return run.id
        finally:
            await engine.dispose()

    return asyncio.run(create())


def test_export_of_a_store_behind_the_migrations_says_to_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'proxrl.db'}"
    database.upgrade(url)
    run_id = _run_in(url)
    database.downgrade(url, "0005")  # as the release before evaluation sessions left it
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="proxrl db upgrade") as stopped:
        proxrl(["export", "--db", url, "--run", run_id, "--format", "jsonl", str(out)])
    assert "0005" in str(stopped.value)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()

    database.upgrade(url)  # upgraded, the same command exports the run (no sessions yet)
    proxrl(["export", "--db", url, "--run", run_id, "--format", "jsonl", str(out)])
    assert out.read_bytes() == b""
