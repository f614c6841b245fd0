"""A proxy killed under load loses nothing it answered.

Eight agents (the real openai SDK, one session each) chat with a real ``proxrl serve`` backed by
a SQLite store; the proxy is killed with SIGKILL while they do, so some requests are in flight
and some turns may be half-way to the store. A new proxy on the same data directory must hold
every turn whose answer reached an agent, with the tokens, the text and the finish reason
that agent was given, and go on serving the same sessions where they left off.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from openai import OpenAI

from tests.support import EngineProcess, ProxyProcess

AGENTS = 8
LOAD_SECONDS = 3.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    with EngineProcess(tiny_model_dir, logs, "--num-threads", "1") as process:
        yield process


def agent(session: dict, answers: list, stop: threading.Event) -> None:
    """Chat until the proxy goes away; keep every answer received."""
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "Count with me: 1 2 3"}]
    while not stop.is_set():
        try:
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, timeout=30
            )
        except (openai.APIConnectionError, openai.APIStatusError):
            return
        answers.append(reply)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "and on"},
        ]
        if len(messages) > 9:  # a new conversation in the same session now and then
            messages = messages[:1]


def test_every_answered_turn_survives_a_killed_proxy(tiny_model_dir, tmp_path, engine) -> None:
    data_dir = tmp_path / "data"
    first = ProxyProcess(tiny_model_dir, data_dir, "--engines", engine.url).wait_ready()
    sessions = [first.session(task_id=f"crash-{i}") for i in range(AGENTS)]
    answers: list[list] = [[] for _ in sessions]
    stop = threading.Event()
    threads = [
        threading.Thread(target=agent, args=(session, mine, stop), daemon=True)
        for session, mine in zip(sessions, answers, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        time.sleep(LOAD_SECONDS)
        first.process.kill()  # SIGKILL: no shutdown, no flush
        first.process.wait(timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        first.stop()
    answered = sum(len(mine) for mine in answers)
    assert answered >= AGENTS, "the agents got too few answers before the kill to test anything"

    with ProxyProcess(tiny_model_dir, data_dir, "--engines", engine.url) as second:
        for session, mine in zip(sessions, answers, strict=True):
            turns = second.get_session(session["session_id"])["turns"]
            stored = {turn["completion_id"]: turn for turn in turns}
            for reply in mine:
                turn = stored[reply.id]  # every answer an agent got is in the store
                assert len(turn["completion_ids"]) == reply.usage.completion_tokens
                assert turn["response"]["content"] == reply.choices[0].message.content
                assert turn["finish_reason"] == reply.choices[0].finish_reason
            # at most the one request in flight at the kill was stored without being answered
            assert len(turns) - len(mine) in (0, 1)
            assert [t["turn_index"] for t in turns] == list(range(len(turns)))

        # The sessions go on: the next turn follows the last stored one.
        session = sessions[0]
        client = OpenAI(base_url=f"{second.url}/v1", api_key=session["api_key"], max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=4
        )
        turns = second.get_session(session["session_id"])["turns"]
        assert turns[-1]["completion_id"] == reply.id
        assert turns[-1]["turn_index"] == len(turns) - 1
