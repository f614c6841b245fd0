"""A publish whose load is given up on, and that finishes later anyway, leaves a way back.

The engines stay paused at most ``--weights-pause-limit-s``: a load past it (weight files on a
mount that hangs after they were checked) is abandoned with a 502 and the engines resume. An
engine whose load then finishes serves the new version's tag, which the run does not serve, so
the pool takes it out of rotation. Before: with every engine out that way, the next publish
found no engine in rotation (503) and the fleet stayed empty until a restart. Now a publish
loads the engines that are out only for their version, and they come back with it.

The real embedded engine serves here; its weight read is slowed (the hung mount: fault
injection, the publish and the pool are what is tested).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.engine import service as engine_service
from tests.api.api_support import Api, assert_error
from tests.api.conftest import ThreadedEngine, app_with_own_engine

PAUSE_LIMIT_S = 0.5
SLOW_READ_S = 2.0


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[Api, ThreadedEngine]]:
    """An app with an engine of its own (the weights it loads are this module's business)."""
    data_dir = tmp_path_factory.mktemp("publish-abandoned")
    with app_with_own_engine(
        tiny_model_dir, data_dir, weights_pause_limit_s=PAUSE_LIMIT_S, health_interval_s=0.2
    ) as found:
        yield found


def test_an_engine_whose_abandoned_load_finished_late_is_loaded_by_the_next_publish(
    setup, tiny_model_dir: Path, monkeypatch
):
    api, engine = setup
    read = engine_service.weights.read_checkpoint
    finished = threading.Event()

    def hung_mount(path):
        time.sleep(SLOW_READ_S)
        try:
            return read(path)
        finally:
            finished.set()

    monkeypatch.setattr(engine_service.weights, "read_checkpoint", hung_mount)
    session = api.new_session()
    assert api.chat(session)["choices"]
    started = time.monotonic()
    reply = api.call("POST", "/admin/weights", json={"model_path": str(tiny_model_dir)})
    assert_error(reply, 502, code="weights_load_timeout")
    assert time.monotonic() - started < SLOW_READ_S  # given up on at the limit
    assert finished.wait(timeout=30)  # the load finished anyway: the engine serves version 1
    monkeypatch.setattr(engine_service.weights, "read_checkpoint", read)  # the mount is back
    pool = api.http.app.state.ctx.pool  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while pool.healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    (state,) = pool.engines
    assert not state.healthy and state.off_version, state.last_error
    assert "serves version 1, not 0" in (state.last_error or "")
    assert_error(api.call("POST", "/v1/chat/completions", key=session["api_key"], json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
    }), 503)  # fmt: skip
    published = api.ok("POST", "/admin/weights", json={"model_path": str(tiny_model_dir)})
    assert published["policy_version"] == 1
    assert [e["success"] for e in published["engines"]] == [True]
    assert state.healthy and not state.off_version
    answer = api.chat(session)
    assert answer["choices"]
    assert engine.service.scheduler.weight_version == "1"
    time.sleep(0.6)  # health checks now find the version they expect: it stays in rotation
    assert state.healthy
