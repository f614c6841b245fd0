"""What one chat request costs the proxy in Python work, flat in what its session holds.

A session keeps up to ``MAX_CONVERSATIONS`` conversations, and each prompt is tried against the
last turns of every one of them (``prompts.splice``). bench/proxy_cost.py's sessions hold
unrelated chats, as an agent's side requests are: every turn's text was decoded again and cut
into splice units for every later prompt of the session, 16 decodes per request once 16
conversations were kept (3.9 ms of CPU per request against 2.2 ms when each turn's units are
made once).

The proxy app in this process (as in tests/api), on the stub engine (bench/stub_engine.py, in a
thread): one session, unrelated chats one after another. What is counted is work, not time (a
shared machine's CPU time varies by tens of percent): the Python function calls made for each
request, on the event loop's thread and on the prompt thread that renders and tokenizes it.
The requests of a session that holds 16 other conversations must cost within 10 % of those of
one that holds one to three (on the code that decoded every turn again: 38 % more).
"""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.proxy import prompts
from server.proxy.session_cache import MAX_CONVERSATIONS
from tests.api.api_support import Api, app_settings
from tests.integration.test_repeated_prompt_cost import PythonCalls, stub_url  # noqa: F401

EXTRA = 8  # requests after the session holds all the conversations it keeps
BOUND = 1.10  # calls per request with 16 conversations held, over those with 1-3 held


def body(index: int) -> dict[str, Any]:
    """An unrelated chat: a conversation of its own in the session."""
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": f"You are assistant number {index}; be brief."},
            {"role": "user", "content": f"What is {index} + {3 * index + 1}? Say it in words."},
        ],
        "max_tokens": 16,
        "seed": index,
    }


@pytest.mark.timeout(120)
def test_a_request_costs_the_same_whatever_else_its_session_holds(
    tiny_model_dir: Path,
    stub_url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from server.main import create_app

    off_thread: list[PythonCalls] = []
    lock = threading.Lock()
    original = prompts.off_loop

    async def counted_off_loop(work: Callable[[], Any]) -> Any:
        calls = PythonCalls()
        with lock:
            off_thread.append(calls)

        def counted() -> Any:
            sys.setprofile(calls.profile)
            try:
                return work()
            finally:
                sys.setprofile(None)

        return await original(counted)

    monkeypatch.setattr(prompts, "off_loop", counted_off_loop)
    with TestClient(create_app(app_settings(tiny_model_dir, stub_url, tmp_path))) as client:
        api = Api(client, tiny_model_dir)
        session = api.new_session()
        path = f"/sessions/{session['session_id']}/v1/chat/completions"
        counts = []
        for index in range(MAX_CONVERSATIONS + 1 + EXTRA):
            loop_calls = PythonCalls()
            client.portal.call(sys.setprofile, loop_calls.profile)  # type: ignore[union-attr]
            api.ok("POST", path, key=session["api_key"], json=body(index))
            client.portal.call(sys.setprofile, None)  # type: ignore[union-attr]
            counts.append(loop_calls.count + off_thread[-1].count)
        stored = api.session(session["session_id"])

    assert len(off_thread) == len(counts)  # each request's prompt was counted
    assert stored["turn_count"] == len(counts)
    one_held = statistics.median(counts[1:4])
    all_held = statistics.median(counts[MAX_CONVERSATIONS + 1 :])
    print(f"calls per request: {one_held} with 1-3 conversations held, {all_held} with 16")
    assert all_held <= BOUND * one_held, (one_held, all_held, counts)
