"""Three ``proxrl serve`` replicas over one Postgres behind HAProxy, each part on its own host (a
network namespace, tests/reliability/multihost.py): Postgres, one embedded engine, the replicas,
and HAProxy with the clients in the root namespace. Many agents converse at once through
HAProxy (plain HTTP, every third turn streamed), retrying as an agent would on a connection
error, a broken stream, a 502, 503 or 504.

Drill 1: one replica SIGKILLed mid-load. Drill 2: the three restarted one at a time under load
(SIGTERM, its graceful shutdown, started again, healthy, back in HAProxy's rotation).

What must hold after each: every turn a client was answered (a 200) is in the store with the
text, token count and finish reason the client got, at a contiguous turn index; each session's
turns continue the row of its previous answered turn whenever the prompt extends it (the merge
rule, as on one replica: tests/reliability/test_proxy_crash.py); the run's admission bound held
across replicas (exactly the bound admitted of more concurrent creations, every later creation
a 429, the places held in the store never above it); no 500 and no session given up. The 5xx
clients saw (what HAProxy could not retry), their broken streams and the time to recover are
printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from server.store import database
from server.store import sessions as store
from tests.reliability import multihost
from tests.reliability.multihost import ADMIN_KEY, HAProxy, Network, Replica

pytestmark = [pytest.mark.slow]

# The issue asks 500: PROXRL_DRILL_SESSIONS=500. 100 by default: on 2 cores shared by the
# engine, three replicas, Postgres, HAProxy and the clients, 500 take past the few minutes a
# drill may (tests/reliability/README.md has both figures).
SESSIONS = int(os.environ.get("PROXRL_DRILL_SESSIONS", "100"))
EXTRA = max(SESSIONS // 5, 10)  # creations past the bound, all refused
MAX_TOKENS = 6
ATTEMPTS = 12  # per turn, before the agent gives up
# How HAProxy spreads requests (multihost.BALANCE): by session key until the replicas check a
# session's cached state against the store (issue 27 part 1); roundrobin shows why.
BALANCE = os.environ.get("PROXRL_DRILL_BALANCE", "session")
RETRY_STATUS = (502, 503, 504)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class Broken(Exception):
    """A stream that ended without its last event."""


@dataclass
class Answer:
    completion_id: str
    content: str
    tokens: int
    finish_reason: str


@dataclass
class Load:
    """What the agents were told, and what went wrong on the way."""

    answered: dict[str, list[Answer]] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)  # every non-200 status seen
    transport_errors: Counter = field(default_factory=Counter)  # by exception class
    broken_streams: int = 0
    gave_up: list[str] = field(default_factory=list)
    in_flight: set[str] = field(default_factory=set)  # sessions with a request out
    outages: list[float] = field(default_factory=list)  # first failure to next answer, seconds
    streams_in_flight: int = 0
    most_streams_in_flight: int = 0

    def turns(self) -> int:
        return sum(map(len, self.answered.values()))

    def fivexx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


async def ask(http: httpx.AsyncClient, key: str, body: dict, load: Load) -> Answer:
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        reply = await http.post("/v1/chat/completions", json=body, headers=headers)
        if reply.status_code != 200:
            raise httpx.HTTPStatusError(reply.text[:200], request=reply.request, response=reply)
        data = reply.json()
        choice = data["choices"][0]
        return Answer(
            data["id"],
            choice["message"]["content"],
            data["usage"]["completion_tokens"],
            choice["finish_reason"],
        )
    parts: list[str] = []
    finish = completion_id = None
    tokens = -1
    load.streams_in_flight += 1
    load.most_streams_in_flight = max(load.most_streams_in_flight, load.streams_in_flight)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                await reply.aread()
                raise httpx.HTTPStatusError(reply.text[:200], request=reply.request, response=reply)
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if finish is None or tokens < 0:
                        raise Broken(line)
                    return Answer(completion_id, "".join(parts), tokens, finish)
                event = json.loads(line[len("data: ") :])
                completion_id = event["id"]
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    parts.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
        raise Broken("no [DONE]")
    finally:
        load.streams_in_flight -= 1


async def attempt(http: httpx.AsyncClient, key: str, body: dict, load: Load) -> Answer | None:
    """One try: the answer, or None (counted) after what an agent retries."""
    try:
        return await ask(http, key, body, load)
    except httpx.HTTPStatusError as error:
        load.statuses[error.response.status_code] += 1
        if error.response.status_code not in RETRY_STATUS:
            raise
    except httpx.TransportError as error:
        load.transport_errors[type(error).__name__] += 1
    except Broken:
        load.broken_streams += 1
    return None


async def converse(
    http: httpx.AsyncClient, session: dict, load: Load, stop: asyncio.Event, max_turns: int
) -> None:
    """One agent: turns until ``stop`` (or ``max_turns``), each retried until answered."""
    session_id = session["session_id"]
    messages = [{"role": "user", "content": f"Count with me from {len(session_id)}."}]
    answered = load.answered.setdefault(session_id, [])
    for turn in range(max_turns):
        if stop.is_set():
            return
        body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
        if turn % 3 == 1:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        failed_at = None
        for tries in range(ATTEMPTS):
            load.in_flight.add(session_id)
            try:
                answer = await attempt(http, session["api_key"], body, load)
            finally:
                load.in_flight.discard(session_id)
            if answer is not None:
                break
            failed_at = failed_at or time.monotonic()
            await asyncio.sleep(min(0.25 * 2**tries, 3.0))
        else:
            load.gave_up.append(session_id)
            return
        if failed_at is not None:
            load.outages.append(time.monotonic() - failed_at)
        answered.append(answer)
        messages += [
            {"role": "assistant", "content": answer.content},
            {"role": "user", "content": "And on."},
        ]


async def create_sessions(url: str, run_id: str, count: int) -> tuple[list[dict], Counter]:
    """``count`` sessions asked of the replicas at once: those created, and every status."""
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=60) as http:
        replies = await asyncio.gather(
            *(http.post("/rl/sessions", json={"run_id": run_id}) for _ in range(count))
        )
    statuses = Counter(reply.status_code for reply in replies)
    return [reply.json() for reply in replies if reply.status_code == 201], statuses


def new_run(url: str, bound: int) -> str:
    """A run whose admission bound is ``bound`` places: (max_staleness + 1) * batch_size."""
    config = {"batch_size": bound, "max_staleness": 0, "admission_wait_s": 0}
    reply = httpx.post(
        f"{url}/rl/runs", json={"name": "drill", "config": config}, headers=ADMIN, timeout=30
    )
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


async def places_held(db_url: str, run_id: str) -> int:
    engine = database.connect(db_url)
    try:
        async with database.sessionmaker(engine)() as db:
            return sum(count for _, _, count, _ in await store.held_places(db, run_id))
    finally:
        await engine.dispose()


@dataclass
class Deployment:
    network: Network
    db_url: str
    replicas: list[Replica]
    haproxy: HAProxy
    log_dir: Path

    def all_up(self, timeout: float = 180.0) -> None:
        """Every replica running and in HAProxy's rotation (a killed one started again)."""
        for replica in self.replicas:
            if replica.process is None or replica.process.process.poll() is not None:
                replica.start()
        for replica in self.replicas:
            replica.wait_ready(timeout)
        self.in_rotation(timeout=30)

    def in_rotation(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while set(self.haproxy.statuses().values()) != {"UP"}:
            assert time.monotonic() < deadline, self.haproxy.statuses()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multihost")
    with Network(5) as network:
        db_host, engine_host, *replica_hosts = network.hosts
        postgres = multihost.start_postgres(db_host)
        engine = haproxy = None
        replicas: list[Replica] = []
        try:
            db_url = postgres.new_database()
            engine = multihost.start_engine(
                engine_host, tiny_model_dir, log_dir, "--max-running-requests", "256"
            )
            public = f"http://{network.gateway}:{multihost.HAPROXY_PORT}"
            replicas = [
                Replica(host, tiny_model_dir, engine.url, db_url, public, log_dir)
                for host in replica_hosts
            ]
            # the first replica makes the store's tables; the others start on them
            replicas[0].start().wait_ready()
            haproxy = HAProxy(network.gateway, replicas, log_dir, BALANCE).wait_ready()
            result = Deployment(network, db_url, replicas, haproxy, log_dir)
            result.all_up()
            yield result
        finally:
            for replica in replicas:
                replica.stop()
            if haproxy is not None:
                haproxy.stop()
            if engine is not None:
                engine.stop()
            postgres.stop()


def run_load(url: str, sessions: list[dict], load: Load, stop: threading.Event, turns: int):
    """The agents, on a thread of their own, until ``stop`` or each has had ``turns`` turns."""

    async def agents() -> None:
        limits = httpx.Limits(max_connections=len(sessions) + 16)
        timeout = httpx.Timeout(300, connect=5)  # see multihost.HAPROXY_CONFIG's timeouts
        done = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()

        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
            await asyncio.gather(*(converse(http, s, load, done, turns) for s in sessions))
        watcher.cancel()

    thread = threading.Thread(target=asyncio.run, args=(agents(),), daemon=True)
    thread.start()
    return thread


def admitted(deployment: Deployment) -> tuple[str, list[dict]]:
    """A fresh run with a bound of SESSIONS, and its sessions: SESSIONS + EXTRA asked at once
    through HAProxy, exactly SESSIONS created, the rest 429."""
    url = deployment.haproxy.url
    run_id = new_run(url, SESSIONS)
    sessions, statuses = asyncio.run(create_sessions(url, run_id, SESSIONS + EXTRA))
    assert statuses == Counter({201: SESSIONS, 429: EXTRA}), statuses
    return run_id, sessions


def check_bound(deployment: Deployment, run_id: str) -> None:
    """More creations are refused, and the store holds exactly the bound."""
    _, statuses = asyncio.run(create_sessions(deployment.haproxy.url, run_id, EXTRA))
    assert statuses == Counter({429: EXTRA}), statuses
    assert asyncio.run(places_held(deployment.db_url, run_id)) == SESSIONS


def check_stored(deployment: Deployment, load: Load, orphans_per_session: int) -> dict[str, int]:
    """Every answered turn stored as answered; rows continued as on one replica. Figures."""
    tokenizer = AutoTokenizer.from_pretrained(deployment.replicas[0].model_dir)
    stored_turns = continued = extends = extra_rows = 0
    with httpx.Client(base_url=deployment.haproxy.url, headers=ADMIN, timeout=60) as http:
        for session_id, answers in load.answered.items():
            reply = http.get(f"/rl/sessions/{session_id}")
            assert reply.status_code == 200, reply.text
            view = reply.json()
            turns = view["turns"]
            stored_turns += len(turns)
            assert [t["turn_index"] for t in turns] == list(range(len(turns)))
            # a request in flight at a kill may be stored unanswered; its retry is another turn
            assert 0 <= len(turns) - len(answers) <= orphans_per_session, session_id
            by_id = {turn["completion_id"]: turn for turn in turns}
            previous = None
            for answer in answers:
                turn = by_id[answer.completion_id]  # every answer an agent got is stored
                assert len(turn["completion_ids"]) == answer.tokens
                assert turn["response"]["content"] == answer.content
                assert turn["finish_reason"] == answer.finish_reason
                if previous is not None:
                    said = tokenizer.decode(previous["prompt_ids"] + previous["completion_ids"])
                    if tokenizer.decode(turn["prompt_ids"]).startswith(said):
                        extends += 1
                        assert turn["row_index"] == previous["row_index"], (previous, turn)
                        continued += 1
                previous = turn
            extra_rows += view["row_count"] - 1
    return {
        "turns_answered": load.turns(),
        "turns_stored": stored_turns,
        "extending_pairs": extends,
        "continued_row": continued,
        "extra_rows": extra_rows,
    }


def report(name: str, load: Load, figures: dict, haproxy: dict, extra: dict) -> str:
    outage = max(load.outages, default=0.0)
    return (
        f"\n{name}: {SESSIONS} sessions, balance {BALANCE}; {figures}; client 5xx {load.fivexx()} "
        f"(statuses {dict(load.statuses)}), transport errors {dict(load.transport_errors)}, "
        f"broken streams {load.broken_streams}, most streams in flight "
        f"{load.most_streams_in_flight}; longest wait from a failure to the answer "
        f"{outage:.2f} s; haproxy {haproxy}; {extra}"
    )


def check_load(load: Load) -> None:
    assert not load.gave_up, f"{len(load.gave_up)} sessions gave up"
    assert all(status in RETRY_STATUS for status in load.statuses), load.statuses


@pytest.mark.timeout(600)
def test_sigkill_a_replica_under_load(deployment: Deployment) -> None:
    deployment.all_up()
    began = time.monotonic()
    run_id, sessions = admitted(deployment)
    before = deployment.haproxy.counters()
    load, stop = Load(), threading.Event()
    agents = run_load(deployment.haproxy.url, sessions, load, stop, turns=6)
    try:
        # mid-load: a third of the turns answered and streams open
        deadline = time.monotonic() + 240
        while load.turns() < SESSIONS * 2 or load.streams_in_flight < 1:
            assert time.monotonic() < deadline, f"too slow: {load.turns()} turns"
            assert agents.is_alive(), "the agents stopped before the kill"
            time.sleep(0.01)
        streams, in_flight = load.streams_in_flight, len(load.in_flight)
        victim = deployment.replicas[1]
        victim.kill()
        killed = time.monotonic()
        check_bound(deployment, run_id)  # two replicas left: still the bound
        agents.join(timeout=300)
        assert not agents.is_alive(), f"the agents did not finish: {load.turns()} turns"
    finally:
        stop.set()
        agents.join(timeout=60)
    finished = time.monotonic()
    check_load(load)
    assert load.turns() == SESSIONS * 6
    figures = check_stored(deployment, load, orphans_per_session=1)
    counters = deployment.haproxy.counters()
    haproxy = {k: counters[k] - before[k] for k in counters}
    print(
        report(
            "SIGKILL a replica",
            load,
            figures,
            haproxy,
            {
                "in flight at the kill": in_flight,
                "streams at the kill": streams,
                "load after the kill s": round(finished - killed, 1),
                "wall s": round(time.monotonic() - began, 1),
            },
        )
    )
    deployment.all_up()  # the killed replica back, for the next drill
    check_bound(deployment, run_id)


@pytest.mark.timeout(900)
def test_rolling_restart_under_load(deployment: Deployment) -> None:
    deployment.all_up()
    began = time.monotonic()
    run_id, sessions = admitted(deployment)
    before = deployment.haproxy.counters()
    load, stop = Load(), threading.Event()
    agents = run_load(deployment.haproxy.url, sessions, load, stop, turns=1000)
    restarts = []
    try:
        deadline = time.monotonic() + 240
        while load.turns() < SESSIONS:
            assert time.monotonic() < deadline, f"too slow: {load.turns()} turns"
            time.sleep(0.05)
        for replica in deployment.replicas:
            at = load.turns()
            stopped = replica.terminate()  # graceful: in-flight answered
            replica.start().wait_ready()
            deployment.in_rotation(timeout=30)
            restarts.append((round(stopped, 1), load.turns() - at))
        check_bound(deployment, run_id)
        time.sleep(2)  # load on the restarted fleet
    finally:
        stop.set()
        agents.join(timeout=120)
    assert not agents.is_alive(), "the agents did not stop"
    check_load(load)
    figures = check_stored(deployment, load, orphans_per_session=len(deployment.replicas))
    counters = deployment.haproxy.counters()
    haproxy = {k: counters[k] - before[k] for k in counters}
    print(
        report(
            "rolling restart",
            load,
            figures,
            haproxy,
            {
                "(shutdown s, turns answered meanwhile) per replica": restarts,
                "wall s": round(time.monotonic() - began, 1),
            },
        )
    )
