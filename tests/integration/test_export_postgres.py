"""Trajectory export from a real ``proxrl serve`` on PostgreSQL: the endpoint and the
``proxrl export`` command (a process of its own, reading the store directly) write the same
sessions, which ``datasets`` reads back equal to GET /rl/sessions/{id}, field by field."""

from __future__ import annotations

import io
import subprocess
import sys

import datasets
import httpx
import pyarrow.parquet as pq
import pytest

from tests.export_support import assert_record_is_the_session
from tests.support import ROOT, ProxyProcess


@pytest.fixture(scope="module")
def served(postgres, tiny_model_dir, tmp_path_factory):
    """A proxy on a fresh Postgres database with a run of consumed and trainable sessions."""
    db_url = postgres.new_database()
    data_dir = tmp_path_factory.mktemp("export-postgres")
    with (
        ProxyProcess(tiny_model_dir, data_dir, "--db", db_url) as process,
        httpx.Client(base_url=process.url, headers=process.admin, timeout=60) as http,
    ):
        run_id = http.post("/rl/runs", json={"name": "export"}).json()["id"]
        ids = []
        for index in range(5):
            session = process.session(run_id=run_id, task_id=f"t{index % 2}")
            key = {"Authorization": f"Bearer {session['api_key']}"}
            if index % 2:
                body = {"model": "tiny", "prompt": f"{index} + 1 =", "max_tokens": 4}
                reply = http.post("/v1/completions", json=body, headers=key)
            else:
                ask = [{"role": "user", "content": f"What is {index} + 1?"}]
                body = {"model": "tiny", "messages": ask, "max_tokens": 4, "n": 2}
                reply = http.post("/v1/chat/completions", json=body, headers=key)
            assert reply.status_code == 200, reply.text
            sid = session["session_id"]
            assert http.post(f"/rl/sessions/{sid}/reward", json={"reward": index / 4}).is_success
            assert http.post(f"/rl/sessions/{sid}/end").is_success
            ids.append(sid)
            if index == 2:  # the first three are trained
                claim = http.post(f"/rl/runs/{run_id}/claims", json={"max_sessions": 10}).json()
                assert http.post(f"/rl/claims/{claim['claim_id']}/confirm").is_success
        views = {sid: process.get_session(sid) for sid in ids}
        yield {"http": http, "db": db_url, "run": run_id, "ids": ids, "views": views}


def test_endpoint_and_command_export_the_sessions_from_postgres(served, tmp_path):
    http, views = served["http"], served["views"]
    assert [views[sid]["status"] for sid in served["ids"]] == ["consumed"] * 3 + ["trainable"] * 2
    for form in ("jsonl", "parquet"):
        reply = http.get(f"/rl/runs/{served['run']}/export", params={"format": form})
        assert reply.status_code == 200, reply.text
        out = tmp_path / f"cli.{form}"
        command = [sys.executable, "-m", "server.cli", "export", "--db", served["db"]]
        command += ["--run", served["run"], "--format", form, str(out)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "wrote 3 session(s)" in done.stderr
        if form == "jsonl":
            assert out.read_bytes() == reply.content
        else:
            assert pq.read_table(out).equals(pq.read_table(io.BytesIO(reply.content)))
        loaded = datasets.load_dataset("json" if form == "jsonl" else form, data_files=str(out))
        records = list(loaded["train"])
        assert [r["session_id"] for r in records] == served["ids"][:3]  # consumed, oldest first
        for record in records:
            assert_record_is_the_session(record, views[record["session_id"]])
