"""Every reader of the store survives rows an older version stored: session metadata holding a
lone surrogate (the JSON escape ``"\\ud800"``), metadata nested 900 deep, a turn's messages with
a lone surrogate, beside a 2 MB metadata and one with NUL characters that are fine to serve.

The rows are written into the store directly (as the old code stored them, through SQLAlchemy's
JSON), on a real SQLite file and a real PostgreSQL database, behind the app of ``create_app``
with the real engine. Then: a claim answers 200 and drops each session whose metadata it cannot
send, with an ``unservable`` reason (never a 500 after its commit, which left the sessions
claimed by nobody); GET /rl/sessions/{id} shows the rest and names what it ``withheld``; the
export (HTTP and ``export_file``) writes every other session and says which it skipped and why;
the dashboard's session page and its API read every session. Before: 500s, and 0 of 14
sessions exported."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqlalchemy import select, update

from server.export.writers import JsonlWriter
from server.rl.export import chosen_sessions, export_file
from server.store import database
from server.store.tables import Session, Turn
from tests.api import store_backends
from tests.api.api_support import Api

backend_api, store_url = store_backends.backend_api, store_backends.store_url  # the fixtures

GOOD = 10
NESTED_900 = json.loads("[" * 900 + "]" * 900)
BAD_METADATA = {
    "surrogate": {"note": "\ud800"},
    "deep": {"tree": NESTED_900},
}
SERVED_METADATA = {
    "huge": {"blob": "x" * 2_000_000},
    "nul": {"text": "a\x00b"},
}


def trainable_session(api: Api, run: dict) -> str:
    """A session of ``run`` with one turn, rewarded and ended: trainable."""
    session = api.new_session(run["id"], key=run["api_key"])
    api.chat(session)
    api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    return session["session_id"]


def store_as_old_code_did(url: str, metadata: dict[str, dict], bad_turn_session: str) -> None:
    engine = database.connect_sync(url)
    try:
        with engine.begin() as connection:
            for session_id, value in metadata.items():
                connection.execute(
                    update(Session).where(Session.id == session_id).values(meta=value)
                )
            turn_id = connection.scalar(select(Turn.id).where(Turn.session_id == bad_turn_session))
            connection.execute(
                update(Turn)
                .where(Turn.id == turn_id)
                .values(messages=[{"role": "user", "content": "\udc00 lone"}])
            )
    finally:
        engine.dispose()


def test_every_reader_serves_around_what_an_old_version_stored(backend_api: Api, store_url: str):
    api = backend_api
    run = api.new_run()
    good = [trainable_session(api, run) for _ in range(GOOD)]
    bad = {name: trainable_session(api, run) for name in BAD_METADATA}
    served = {name: trainable_session(api, run) for name in SERVED_METADATA}
    bad_turn = good[0]
    store_as_old_code_did(
        store_url,
        {bad[n]: v for n, v in BAD_METADATA.items()}
        | {served[n]: v for n, v in SERVED_METADATA.items()},
        bad_turn,
    )

    # The session view: what it can carry, and what it withheld with why.
    for name, session_id in bad.items():
        view = api.session(session_id)
        assert view["metadata"] == {}
        assert list(view["withheld"]) == ["metadata"], view["withheld"]
        expected = "lone surrogate" if name == "surrogate" else "nesting deeper than 200"
        assert expected in view["withheld"]["metadata"]
        assert len(view["turns"]) == 1 and view["rows"]
    turned = api.session(bad_turn)
    assert turned["withheld"] == {
        "turns[0].messages": "a string UTF-8 cannot encode (a lone surrogate) at [0].content"
    }
    assert turned["turns"][0]["messages"] == []
    for name, session_id in served.items():
        view = api.session(session_id)
        assert view["withheld"] == {} and view["metadata"] == SERVED_METADATA[name]

    # The dashboard: its session page and its API.
    for session_id in [*bad.values(), bad_turn, *served.values()]:
        page = api.call("GET", f"/admin/sessions/{session_id}")
        assert page.status_code == 200 and session_id in page.text
        detail = api.ok("GET", f"/admin/api/sessions/{session_id}")
        assert detail["session_id"] == session_id
        if session_id in bad.values():
            assert 'id="withheld"' in page.text and "metadata" in detail["withheld"]

    # The export, over HTTP and as proxrl export writes it: every other session, the rest named.
    exported = api.call("GET", f"/rl/runs/{run['id']}/export", params={"status": "trainable"})
    assert exported.status_code == 200, exported.text
    lines = [json.loads(line) for line in exported.text.splitlines()]
    skipped_ids = {*bad.values(), bad_turn}
    assert {line["session_id"] for line in lines} == {*good, *served.values()} - skipped_ids
    skipped: dict[str, str] = {}
    out = Path(api.model_dir).parent / "export.jsonl"
    written = asyncio.run(
        export_file(
            store_url,
            chosen_sessions(run["id"], "trainable", None),
            JsonlWriter(),
            out,
            on_skip=skipped.__setitem__,
        )
    )
    assert written == len(lines) == GOOD - 1 + len(SERVED_METADATA)
    assert set(skipped) == skipped_ids
    assert "lone surrogate" in skipped[bad["surrogate"]]
    assert "turns[0].messages" in skipped[bad_turn]

    # The claim: 200, the servable sessions, the others dropped with their reason.
    claim = api.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 100})
    claimed = {s["session_id"]: s for s in claim["sessions"]}
    assert set(claimed) == {*good, *served.values()}
    assert claimed[served["huge"]]["metadata"] == SERVED_METADATA["huge"]
    for session_id in bad.values():
        view = api.session(session_id)
        assert view["status"] == "dropped"
        assert view["drop_reason"].startswith("unservable: its metadata holds ")
    confirmed = api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm", json={})
    assert confirmed["settled"] == len(claimed) + len(bad)
    figures = api.ok("GET", f"/rl/runs/{run['id']}")["training"]["dropped_sessions"]
    assert figures == {"unservable": len(bad)}
