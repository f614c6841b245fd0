"""``proxrl export`` where it cannot finish. On a store an older proxrl left (its migrations
behind the code's): a one-line message naming ``proxrl db upgrade``, never a traceback from a
missing column, and no file written (the server upgrades its store when it starts; the export
command reads the store without a server, so it must say so itself). A write that fails part
way: a one-line message, and no half file left behind."""

from __future__ import annotations

import asyncio
import resource
import signal
import subprocess
import sys

import pytest

from server.cli import main as proxrl
from server.store import database, runs, sessions
from tests.support import ROOT


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


def test_an_export_that_fails_midway_leaves_no_partial_file(tmp_path):
    """A real write error part way (the file-size limit, as a full disk would): the command
    fails, and neither the file nor its ``.partial`` is left behind."""
    url = f"sqlite:///{tmp_path / 'proxrl.db'}"
    database.upgrade(url)
    run_id = _run_in(url)

    async def fill() -> None:
        engine = database.connect(url)
        try:
            async with database.sessionmaker(engine)() as db, db.begin():
                for index in range(1000):
                    await sessions.create_session(db, run_id, f"t{index}", None, {"i": index})
        finally:
            await engine.dispose()

    asyncio.run(fill())
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "server.cli", "export", "--db", url, "--run", run_id]
    command += ["--status", "all", "--format", "jsonl", str(out)]

    def limited() -> None:  # writes past 64 KiB fail with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

    failed = subprocess.run(
        command, capture_output=True, text=True, timeout=120, preexec_fn=limited, cwd=ROOT
    )
    assert failed.returncode != 0, failed.stderr
    assert "File too large" in failed.stderr and "Traceback" not in failed.stderr, failed.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []
