"""A proxy killed under load loses nothing it acknowledged, on SQLite and on Postgres.

Eight agents (the real openai SDK and plain HTTP) work a real ``proxrl serve`` at once: four
keep one long conversation each, rewarding every answered turn; four run short episodes (a new
session, two turns, a session reward, the end). The proxy is SIGKILLed while they do, so some
requests are in flight and some writes half-way to the store. A new proxy on the same store
must hold every session, turn, reward and end whose answer reached an agent (a turn with the
tokens, text and finish reason the agent was given), and the long conversations go on where they
left off: the next turn index, in the same training row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.support import EngineProcess, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LONG_AGENTS = 4
EPISODIC_AGENTS = 4
LOAD_SECONDS = 6.0  # long enough that episodes end before the kill on a busy machine too
FAILED = (openai.APIConnectionError, openai.APIStatusError, httpx.HTTPError)


@dataclass
class Acknowledged:
    """What the agents were told was done, before the proxy died."""

    sessions: list[str] = field(default_factory=list)
    turns: dict[str, list] = field(default_factory=dict)  # session id: the replies, in order
    turn_rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    session_rewards: dict[str, float] = field(default_factory=dict)
    ends: list[str] = field(default_factory=list)
    conversations: dict[str, list] = field(default_factory=dict)  # the long ones, to go on with

    def count(self) -> dict[str, int]:
        return {
            "sessions": len(self.sessions),
            "turns": sum(len(replies) for replies in self.turns.values()),
            "rewards": sum(map(len, self.turn_rewards.values())) + len(self.session_rewards),
            "ends": len(self.ends),
        }


def said(reply) -> dict:
    return {"role": "assistant", "content": reply.choices[0].message.content}


def long_agent(proxy: ProxyProcess, session: dict, done: Acknowledged, stop: threading.Event):
    """One conversation until the proxy goes away, each answered turn rewarded."""
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    session_id = session["session_id"]
    messages = [{"role": "user", "content": "Count with me: 1 2 3"}]
    done.conversations[session_id] = messages
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    with httpx.Client(base_url=proxy.url, headers=headers, timeout=30) as http:
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=8, timeout=30
                )
                done.turns.setdefault(session_id, []).append(reply)
                messages += [said(reply), {"role": "user", "content": "and on"}]
                body = {"reward": 0.5, "completion_id": reply.id}
                answer = http.post(f"/rl/sessions/{session_id}/reward", json=body)
            except FAILED:
                return
            if answer.status_code not in (200, 201):
                return
            done.turn_rewards.setdefault(session_id, {})[reply.id] = 0.5


def episodic_agent(proxy: ProxyProcess, done: Acknowledged, stop: threading.Event) -> None:
    """Short episodes until the proxy goes away: a session, two turns, a reward, the end."""
    with httpx.Client(base_url=proxy.url, headers=proxy.admin, timeout=30) as http:
        while not stop.is_set():
            try:
                created = http.post("/rl/sessions", json={"task_id": "episode"})
                if created.status_code != 201:
                    return
                session = created.json()
                session_id = session["session_id"]
                done.sessions.append(session_id)
                client = OpenAI(
                    base_url=session["base_url"], api_key=session["api_key"], max_retries=0
                )
                messages = [{"role": "user", "content": "Say a number."}]
                for _ in range(2):
                    reply = client.chat.completions.create(
                        model="tiny", messages=messages, max_tokens=8, timeout=30
                    )
                    done.turns.setdefault(session_id, []).append(reply)
                    messages += [said(reply), {"role": "user", "content": "Another."}]
                reward = http.post(f"/rl/sessions/{session_id}/reward", json={"reward": 1.0})
                if reward.status_code not in (200, 201):
                    return
                done.session_rewards[session_id] = 1.0
                if http.post(f"/rl/sessions/{session_id}/end").status_code != 200:
                    return
                done.ends.append(session_id)
            except FAILED:
                return


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    with EngineProcess(tiny_model_dir, logs, "--num-threads", "1") as process:
        yield process


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_every_acknowledged_write_survives_a_killed_proxy(
    tiny_model_dir, tmp_path, engine, store, request
) -> None:
    flags = ["--engines", engine.url]
    if store == "postgres":
        flags += ["--db", request.getfixturevalue("postgres").new_database()]
    data_dir = tmp_path / "data"
    first = ProxyProcess(tiny_model_dir, data_dir, *flags).wait_ready()
    done = Acknowledged()
    long_sessions = [first.session(task_id=f"long-{i}") for i in range(LONG_AGENTS)]
    done.sessions += [s["session_id"] for s in long_sessions]
    stop = threading.Event()
    threads = [
        threading.Thread(target=long_agent, args=(first, s, done, stop), daemon=True)
        for s in long_sessions
    ] + [
        threading.Thread(target=episodic_agent, args=(first, done, stop), daemon=True)
        for _ in range(EPISODIC_AGENTS)
    ]
    try:
        for thread in threads:
            thread.start()
        time.sleep(LOAD_SECONDS)
        first.process.kill()  # SIGKILL: no shutdown, no flush
        killed = time.monotonic()
        first.process.wait(timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        first.stop()
    counts = done.count()
    assert counts["turns"] >= LONG_AGENTS + EPISODIC_AGENTS, f"too little load to test: {counts}"
    assert counts["ends"] >= 1, f"no episode ended before the kill: {counts}"

    with ProxyProcess(tiny_model_dir, data_dir, *flags) as second:
        recovered = time.monotonic() - killed
        stored = {s: second.get_session(s) for s in done.sessions}  # every session is there
        for session_id, replies in done.turns.items():
            turns = stored[session_id]["turns"]
            by_id = {turn["completion_id"]: turn for turn in turns}
            for reply in replies:
                turn = by_id[reply.id]  # every answer an agent got is in the store
                assert len(turn["completion_ids"]) == reply.usage.completion_tokens
                assert turn["response"]["content"] == reply.choices[0].message.content
                assert turn["finish_reason"] == reply.choices[0].finish_reason
            # at most the one request in flight at the kill was stored without being answered
            assert len(turns) - len(replies) in (0, 1)
            assert [t["turn_index"] for t in turns] == list(range(len(turns)))
        for session_id, rewards in done.turn_rewards.items():
            kept = stored[session_id]["rewards"]
            assert rewards.items() <= kept.items()
            assert len(kept) - len(rewards) in (0, 1)  # one posted as the proxy died, at most
        for session_id, reward in done.session_rewards.items():
            assert stored[session_id]["reward"] == reward
        for session_id in done.ends:
            assert stored[session_id]["status"] in ("ended", "trainable"), session_id

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        continued = go_on(second, long_sessions, done, stored, tokenizer)
    print(
        f"\n{store}: acknowledged {counts}; the new proxy answered {recovered:.1f} s after the "
        f"kill; {continued} of {LONG_AGENTS} long conversations continued their row"
    )
    assert continued >= 1


def go_on(
    proxy: ProxyProcess, sessions: list[dict], done: Acknowledged, stored: dict, tokenizer
) -> int:
    """Each long conversation's next turn, on the new proxy: the next turn index, in the row of
    the last stored turn whenever the prompt extends that turn's text (the merge rule: not when
    the last stored turn is one its agent never got, nor when the text the agent was given is
    not the turn's text, as when the tiny random model samples a special token mid-answer).
    The number that continued their row."""
    continued = 0
    for session in sessions:
        session_id = session["session_id"]
        before = stored[session_id]["turns"]
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key=session["api_key"], max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=done.conversations[session_id], max_tokens=4
        )
        turns = proxy.get_session(session_id)["turns"]
        assert len(turns) == len(before) + 1
        new = turns[-1]
        assert new["completion_id"] == reply.id and new["turn_index"] == len(before)
        if not before:
            continue
        last = before[-1]
        said = tokenizer.decode(last["prompt_ids"] + last["completion_ids"])
        extends = tokenizer.decode(new["prompt_ids"]).startswith(said)
        assert new["extends_previous"] == extends, (last, new)
        if extends:
            assert new["row_index"] == last["row_index"]
            continued += 1
    return continued
