"""A store that cannot take writes (here: SQLite locked by another process past the server's
busy timeout, a real fault) is a 503 with Retry-After in each surface's error shape, logged
once for the episode, and the server recovers by itself; nothing answered is lost."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import openai
import pytest

from server.store.database import sqlite_file
from tests.api.api_support import Api, assert_error, sse_events
from tests.api.conftest import app_with_own_engine

BUSY_TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Api]:
    """An app with an engine of its own: its store is made unavailable on purpose."""
    data_dir = tmp_path_factory.mktemp("store-unavailable")
    with app_with_own_engine(tiny_model_dir, data_dir, store_busy_timeout_s=BUSY_TIMEOUT_S) as (
        app,
        _,
    ):
        yield app


@contextmanager
def locked(api: Api) -> Iterator[None]:
    """Another process's write transaction on the store, held until the block ends."""
    path = sqlite_file(api.http.app.state.ctx.settings.database_url)  # type: ignore[attr-defined]
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def stored_turns(api: Api, session: dict) -> int:
    return len(api.session(session["session_id"])["turns"])


def test_every_surface_answers_503_with_retry_after_while_the_store_is_locked(api: Api, caplog):
    caplog.set_level(logging.WARNING)
    session = api.new_session(task_id="store-locked")
    user = [{"role": "user", "content": "hi"}]
    api.chat(session)
    with locked(api):
        with pytest.raises(openai.APIStatusError) as chat:
            api.openai(session["api_key"]).chat.completions.create(
                model="tiny", messages=user, max_tokens=4
            )
        with pytest.raises(anthropic.APIStatusError) as messages:
            api.anthropic(session["api_key"]).messages.create(
                model="tiny", messages=user, max_tokens=4
            )
        streamed = api.call(
            "POST",
            "/v1/chat/completions",
            key=session["api_key"],
            json={"model": "tiny", "messages": user, "max_tokens": 4, "stream": True},
        )
        reward = api.call(
            "POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": 1}
        )
        created = api.call("POST", "/rl/sessions", json={"task_id": "while-locked"})
    for refused in (chat.value.response, messages.value.response, reward, created):
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
    assert chat.value.body["code"] == "store_unavailable"  # type: ignore[index]
    assert messages.value.body["type"] == "error"  # type: ignore[index]
    assert messages.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    for rest in (reward, created):
        error = assert_error(rest, 503, code="store_unavailable")
        assert "locked" in error["message"]
    # a stream already under way ends with the error, and no finish: its answer is not whole
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "store_unavailable"  # type: ignore[index]
    assert not any(c.get("finish_reason") for e in events[:-2] for c in e.get("choices", []))  # type: ignore[union-attr]

    # recovered without a restart (told once the store has been quiet for settle_s); nothing
    # answered lost, nothing refused kept
    time.sleep(api.http.app.state.ctx.store_health.settle_s)  # type: ignore[attr-defined]
    api.chat(session)
    assert stored_turns(api, session) == 2
    assert api.session(session["session_id"])["reward"] is None
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("server")]
    assert [message.split(":")[0].split(" after")[0] for _, message in lines] == [
        "store unavailable",
        "store available again",
    ], lines
    assert all(level == "WARNING" for level, _ in lines) and not any(
        r.exc_info for r in caplog.records
    )


def test_a_store_fault_is_told_from_a_bug() -> None:
    """Real SQLite errors: the faults are named, a wrong statement is not one."""
    from server.store.database import store_fault

    memory = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as wrong:
        memory.execute("SELECT * FROM no_such_table")
    assert store_fault(wrong.value) is None
    with pytest.raises(sqlite3.IntegrityError) as constraint:
        memory.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
        memory.execute("INSERT INTO t VALUES (1), (1)")
    assert store_fault(constraint.value) is None
    memory.execute("PRAGMA max_page_count=2")  # a real "database or disk is full"
    with pytest.raises(sqlite3.OperationalError) as full:
        memory.execute(
            "CREATE TABLE big AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL "
            "SELECT i + 1 FROM n LIMIT 10000) SELECT i, hex(randomblob(64)) FROM n"
        )
    assert store_fault(full.value) == "full (no space left on its disk)"


def test_an_episode_told_from_two_threads_at_once_is_logged_once(caplog, monkeypatch) -> None:
    """The event loop's sessions and the turn writer's thread both tell ``StoreHealth`` of
    faults and commits: however they interleave, an episode begins once and ends once. The
    clock it reads yields to the other threads, so that they do interleave between its check
    and its change (without the lock, failures told were lost: 1,593 of 1,600 counted)."""
    import threading
    import time as real_time

    from server.store import database
    from server.store.database import StoreHealth

    health = StoreHealth(settle_s=0.0)
    start = threading.Barrier(8)

    clock = real_time.time

    def slow_clock() -> float:  # hands the interpreter to another thread mid-check, every time
        real_time.sleep(0.001)
        return clock()

    monkeypatch.setattr(database.time, "time", slow_clock)

    def tell(index: int) -> None:
        start.wait()
        for _ in range(200):
            health.failed(f"disk full ({index})")

    with caplog.at_level(logging.WARNING, logger="server.store.database"):
        threads = [threading.Thread(target=tell, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert health.faults == 1_600
        ends = [threading.Thread(target=health.recovered) for _ in range(8)]
        for thread in ends:
            thread.start()
        for thread in ends:
            thread.join()
    began = [r for r in caplog.records if "store unavailable" in r.getMessage()]
    ended = [r for r in caplog.records if "available again" in r.getMessage()]
    assert len(began) == 1 and len(ended) == 1, [r.getMessage() for r in caplog.records]
    assert "1600 failures" in ended[0].getMessage()
    assert health.available
