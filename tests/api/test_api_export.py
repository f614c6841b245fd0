"""Trajectory export: GET /rl/runs/{id}/export and ``proxrl export``, in JSONL and Parquet, read
back with ``datasets.load_dataset`` (and streaming) and held field by field to
GET /rl/sessions/{id}: every token id, logprob, version, reward and mask.

One run holds sessions of every kind: chat with tools and a tool-call history, n = 2 choices,
text completions with a turn reward, one session over chat, Anthropic Messages (tool_use,
tool_result and thinking blocks) and the Responses API (function calls, reasoning items), a
retried request (an alternative), an open session, an eval session and a dropped one, so the
free-form columns differ in shape from turn to turn in one file.
"""

from __future__ import annotations

import asyncio
import io
import json
from datetime import timedelta, timezone

import datasets
import pyarrow.parquet as pq
import pytest

from server.cli import main as proxrl
from server.export.schema import SESSION, arrow_schema, features, markdown_table
from server.rl import export
from server.store import database
from tests.api.api_support import ADMIN_KEY, Api, assert_error
from tests.export_support import assert_record_is_the_session, time_of

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}


def _reward_and_end(api: Api, session_id: str, reward: float) -> None:
    api.ok("POST", f"/rl/sessions/{session_id}/reward", json={"reward": reward})
    api.ok("POST", f"/rl/sessions/{session_id}/end")


def _chat_with_tools(api: Api, run_id: str) -> str:
    session = api.new_session(run_id, task_id="chat", metadata={"k": [1, {"x": "y"}]})
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "So?"}]},
    ]
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 5, "n": 2}
    api.ok("POST", "/v1/chat/completions", key=session["api_key"], json=body)
    _reward_and_end(api, session["session_id"], 1.0)
    return session["session_id"]


def _completions(api: Api, run_id: str) -> str:
    session = api.new_session(run_id, task_id="text", group_id="g-text")
    body = {"model": "tiny", "prompt": "1 + 1 =", "max_tokens": 4}
    done = api.ok("POST", "/v1/completions", key=session["api_key"], json=body)
    reward = {"reward": 0.25, "completion_id": done["id"]}
    api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json=reward)
    _reward_and_end(api, session["session_id"], 0.5)
    return session["session_id"]


def _mixed_surfaces(api: Api, run_id: str) -> str:
    session = api.new_session(run_id, task_id="mixed")
    key = session["api_key"]
    question = {"role": "user", "content": "What is 2 + 3?"}
    answer = api.chat(session, question["content"], max_tokens=5)["choices"][0]["message"]
    anthropic = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 5,
        "tools": [
            {
                "name": "add",
                "description": "Add two numbers.",
                "input_schema": {"type": "object", "properties": {"a": {"type": "number"}}},
            }
        ],
        "messages": [
            question,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Add them.", "signature": "sig"},
                    {"type": "text", "text": answer["content"] or ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}],
            },
        ],
    }
    api.ok("POST", "/v1/messages", key=key, json=anthropic)
    items = [
        question,
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Add."}]},
        {"type": "function_call", "call_id": "fc_1", "name": "add", "arguments": '{"a":2}'},
        {"type": "function_call_output", "call_id": "fc_1", "output": "5"},
        {"role": "user", "content": "Thanks."},
    ]
    body = {
        "model": "gpt-4o-mini",
        "input": items,
        "max_output_tokens": 5,
        "tools": [
            {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
        ],
    }
    api.ok("POST", "/v1/responses", key=key, json=body)
    _reward_and_end(api, session["session_id"], 0.0)
    return session["session_id"]


def _retried(api: Api, run_id: str) -> str:
    session = api.new_session(run_id, task_id="retry")
    api.chat(session, "Again?", max_tokens=3)
    api.chat(session, "Again?", max_tokens=3)  # the same request: the first is an alternative
    _reward_and_end(api, session["session_id"], 1.0)
    return session["session_id"]


@pytest.fixture(scope="module")
def run(api: Api) -> dict:
    """A run with sessions of every status; ``ids`` by name, the run's ``id``."""
    run_id = api.new_run()["id"]
    ids = {"chat": _chat_with_tools(api, run_id), "text": _completions(api, run_id)}
    empty = api.new_session(run_id, task_id="empty")["session_id"]
    _reward_and_end(api, empty, 1.0)  # trainable with no turn: the claim drops it
    ids["dropped"] = empty
    claim = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 10})
    assert {s["session_id"] for s in claim["sessions"]} == {ids["chat"], ids["text"]}
    api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm")
    ids["mixed"] = _mixed_surfaces(api, run_id)
    ids["retry"] = _retried(api, run_id)
    opened = api.new_session(run_id, task_id="open")
    api.chat(opened, "Still here?", max_tokens=3)
    ids["open"] = opened["session_id"]
    evaluated = api.new_session(run_id, task_id="heldout", eval=True)
    api.chat(evaluated, "1 + 2?", max_tokens=3)
    _reward_and_end(api, evaluated["session_id"], 1.0)
    ids["eval"] = evaluated["session_id"]
    views = {sid: api.session(sid) for sid in ids.values()}
    statuses = {name: views[sid]["status"] for name, sid in ids.items()}
    assert statuses == {
        "chat": "consumed",
        "text": "consumed",
        "dropped": "dropped",
        "mixed": "trainable",
        "retry": "trainable",
        "open": "open",
        "eval": "evaluated",
    }
    return {"id": run_id, "ids": ids, "views": views}


def _export(api: Api, run_id: str, **params: str) -> bytes:
    reply = api.call("GET", f"/rl/runs/{run_id}/export", params=params)
    assert reply.status_code == 200, reply.text
    return reply.content


def _check_all(rows: list[dict], run: dict) -> None:
    views = run["views"]
    assert [r["session_id"] for r in rows] == sorted(
        views, key=lambda sid: (time_of(views[sid]["created_at"]), sid)
    )
    for record in rows:
        assert_record_is_the_session(record, views[record["session_id"]])


def test_the_run_has_every_shape_of_turn(run: dict):
    views = run["views"]
    ids = run["ids"]
    chat = views[ids["chat"]]["turns"]
    assert len(chat) == 2 and chat[0]["tools"] == TOOLS  # n = 2: two choices
    contents = [
        type(message.get("content")).__name__
        for view in views.values()
        for turn in view["turns"]
        for message in turn["messages"] or []
        if isinstance(message, dict)
    ]
    assert {"str", "list"} <= set(contents)  # one field, two shapes, in one file
    assert [t["surface"] for t in views[ids["mixed"]]["turns"]] == ["chat", "messages", "responses"]
    assert views[ids["text"]]["turns"][0]["messages"] is None
    for view in views.values():  # a session counts the conversations its turns are in
        assert view["conversations"] == len({t["conversation"] for t in view["turns"]})
    retry = views[ids["retry"]]
    assert retry["retries"] == 1
    assert [t["alternative"] for r in retry["rows"] for t in r["turns"]].count(True) == 1


def test_jsonl_over_http_loads_with_datasets_and_is_the_sessions(api: Api, run: dict, tmp_path):
    out = tmp_path / "all.jsonl"
    out.write_bytes(_export(api, run["id"], status="all", format="jsonl"))
    loaded = datasets.load_dataset("json", data_files=str(out), split="train")
    _check_all(list(loaded), run)
    streamed = datasets.load_dataset("json", data_files=str(out), split="train", streaming=True)
    assert list(streamed) == list(loaded)
    assert loaded.features == features()  # Arrow's inference finds the documented types


def test_parquet_over_http_loads_with_datasets_and_is_the_sessions(api: Api, run: dict, tmp_path):
    out = tmp_path / "all.parquet"
    out.write_bytes(_export(api, run["id"], status="all", format="parquet"))
    assert pq.read_schema(out).equals(arrow_schema())
    loaded = datasets.load_dataset("parquet", data_files=str(out), split="train")
    _check_all(list(loaded), run)
    streamed = datasets.load_dataset("parquet", data_files=str(out), split="train", streaming=True)
    assert list(streamed) == list(loaded)
    assert loaded.features == features()


def _database(api: Api) -> str:
    return api.http.app.state.ctx.settings.database_url


def test_the_command_line_writes_the_same_files(api: Api, run: dict, tmp_path, capsys):
    for form in ("jsonl", "parquet"):
        out = tmp_path / f"cli.{form}"
        args = ["export", "--db", _database(api), "--run", run["id"], "--status", "all"]
        proxrl([*args, "--format", form, str(out)])
        assert f"wrote {len(run['ids'])} session(s)" in capsys.readouterr().err
        served = _export(api, run["id"], status="all", format=form)
        if form == "jsonl":
            assert out.read_bytes() == served
        else:
            assert pq.read_table(out).equals(pq.read_table(io.BytesIO(served)))
        assert not out.with_name(out.name + ".partial").exists()


def _ids(data: bytes) -> set[str]:
    return {json.loads(line)["session_id"] for line in data.splitlines()}


def test_status_and_since_choose_the_sessions(api: Api, run: dict):
    ids, views = run["ids"], run["views"]
    assert _ids(_export(api, run["id"])) == {ids["chat"], ids["text"]}  # consumed by default
    assert _ids(_export(api, run["id"], status="trainable")) == {ids["mixed"], ids["retry"]}
    since = views[ids["mixed"]]["created_at"]
    later = {ids["mixed"], ids["retry"], ids["open"], ids["eval"]}
    assert _ids(_export(api, run["id"], status="all", since=since)) == later
    naive = time_of(since).replace(tzinfo=None).isoformat()  # no zone: UTC
    assert _ids(_export(api, run["id"], status="all", since=naive)) == later
    shifted = time_of(since).astimezone(timezone(timedelta(hours=2))).isoformat()
    assert _ids(_export(api, run["id"], status="all", since=shifted)) == later
    assert _ids(_export(api, run["id"], status="all", since="1h")) == set(ids.values())
    assert _export(api, run["id"], status="all", since="2999-01-01T00:00:00Z") == b""


def test_an_empty_export_is_a_valid_empty_file(api: Api, tmp_path):
    run_id = api.new_run()["id"]
    assert _export(api, run_id, status="all") == b""
    empty = _export(api, run_id, status="all", format="parquet")
    table = pq.read_table(io.BytesIO(empty))
    assert table.num_rows == 0 and table.schema.equals(arrow_schema())
    out = tmp_path / "empty.jsonl"
    proxrl(["export", "--db", _database(api), "--run", run_id, "--format", "jsonl", str(out)])
    assert out.read_bytes() == b""


def test_the_export_streams_with_its_count(api: Api, run: dict):
    path = f"/rl/runs/{run['id']}/export"
    with api.http.stream("GET", path, params={"status": "all"}, headers=_admin()) as reply:
        assert reply.headers["content-type"] == "application/x-ndjson"
        assert reply.headers["x-export-sessions"] == str(len(run["ids"]))
        lines = list(reply.iter_lines())
    assert len(lines) == len(run["ids"])


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_bad_input_is_refused_in_our_shape(api: Api, run: dict, tmp_path):
    path = f"/rl/runs/{run['id']}/export"
    assert_error(api.call("GET", "/rl/runs/run_nope/export"), 404)
    assert_error(api.call("GET", path, params={"status": "eaten"}), 422)
    assert_error(api.call("GET", path, params={"format": "csv"}), 422)
    assert_error(api.call("GET", path, params={"since": "yesterday"}), 422)
    assert_error(api.call("GET", path, key=None), 401)
    session_key = api.new_session(api.new_run()["id"])["api_key"]  # another run's session
    assert_error(api.call("GET", path, key=session_key), 403)
    with pytest.raises(SystemExit, match="run_nope"):
        proxrl(
            [
                "export",
                "--db",
                _database(api),
                "--run",
                "run_nope",
                "--format",
                "jsonl",
                str(tmp_path / "x.jsonl"),
            ]
        )
    assert not (tmp_path / "x.jsonl").exists()
    nowhere = ["--data-dir", str(tmp_path / "nowhere"), "--run", run["id"], "--format", "jsonl"]
    with pytest.raises(SystemExit, match="no store at"):
        proxrl(["export", *nowhere, str(tmp_path / "y.jsonl")])
    assert not (tmp_path / "nowhere").exists()  # not created empty


def test_a_large_jsonl_export_loads_in_chunks_with_the_documented_features(
    api: Api, run: dict, tmp_path
):
    """``datasets`` fixes a JSON file's types from its first chunk (10 MB): past it, a column
    null throughout that chunk cannot take a value. ``features()`` is the way through."""
    out = tmp_path / "chunks.jsonl"
    out.write_bytes(_export(api, run["id"], status="all"))
    small = {"chunksize": 2048}  # a chunk per session or so, as a large export would have
    loaded = datasets.load_dataset(
        "json", data_files=str(out), split="train", features=features(), **small
    )
    _check_all(list(loaded), run)


def test_the_schema_table_covers_every_column():
    table = "\n".join(markdown_table())
    for column in SESSION:
        assert f"`{column.name}`" in table
        for field in column.fields:
            assert f"`{column.name}[].{field.name}`" in table


def test_pages_follow_one_another_without_a_gap_or_a_repeat(api: Api, run: dict):
    """Small pages over the run (7 sessions: pages of 2, 2, 2, 1) give the one-page export."""

    async def collect(page_size: int) -> list[list[str]]:
        engine = database.connect(_database(api))
        try:
            chosen = export.chosen_sessions(run["id"], "all", None)
            maker = database.sessionmaker(engine)
            return [
                [record["session_id"] for record in page]
                async for page in export.record_pages(maker, chosen, page_size)
            ]
        finally:
            await engine.dispose()

    (whole,) = asyncio.run(collect(100))
    pages = asyncio.run(collect(2))
    assert [len(page) for page in pages] == [2, 2, 2, 1]
    assert [sid for page in pages for sid in page] == whole
    assert [len(page) for page in asyncio.run(collect(7))] == [7]  # a full last page, then none


def test_the_run_is_named_by_its_id_or_its_name(api: Api, tmp_path):
    """`--run default` is the server's first run; a name several runs share, or none has,
    is refused in one line that says what --run takes and where to find it."""
    runs = api.ok("GET", "/rl/runs")
    default = next(r for r in runs if r["is_default"])
    api.new_session(default["id"], eval=True)  # something to export: ended, never trained
    db = ["--db", _database(api), "--status", "all", "--format", "jsonl"]
    proxrl(["export", *db, "--run", default["id"], str(tmp_path / "by-id.jsonl")])
    proxrl(["export", *db, "--run", "default", str(tmp_path / "by-name.jsonl")])
    by_name = (tmp_path / "by-name.jsonl").read_bytes()
    assert by_name and by_name == (tmp_path / "by-id.jsonl").read_bytes()
    api.new_run(), api.new_run()  # two more runs named "api-test"
    with pytest.raises(SystemExit, match=r"runs are named 'api-test'; give one's id: run-"):
        proxrl(["export", *db, "--run", "api-test", str(tmp_path / "x.jsonl")])
    with pytest.raises(SystemExit) as refused:
        proxrl(["export", *db, "--run", "no-such-run", str(tmp_path / "x.jsonl")])
    message = str(refused.value)
    assert message.startswith("proxrl export: no run 'no-such-run' in the store; --run takes")
    assert "/admin/runs" in message and "GET /rl/runs" in message and "\n" not in message
    assert not (tmp_path / "x.jsonl").exists()
