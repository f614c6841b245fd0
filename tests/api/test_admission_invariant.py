"""The staleness bound as an invariant of the running app: random sequences of admissions,
turns, ends, claims, trained marks, drops, confirms, publishes and trainer restarts, each a real
HTTP call against the in-process proxy and its SQLite store, checked after every step.

A training session holds a place from its admission until a step first trains it (its claim is
marked trained) or it is consumed or dropped; sessions that share a group key (group_id, else
task_id under a group_size G > 1) hold max(G, members) places while they gather
(``server.rl.admission``). Runs here keep the default group_timeout_s (600 s) and a sequence
runs for seconds, so every group gathers throughout: the end of gathering is held to the rule by
the pure property in tests/unit/test_admission_and_choices.py and by
tests/unit/test_staleness_sim.py against the store. The rule is restated here from the docs,
not imported, so that the test is an oracle for the server rather than a copy of it:

- a session's cost: 1 without a key or without a G > 1; G for a group's first held member; 0 for
  a member of a group still short of G; 1 beyond it;
- admitted iff cost == 0, or no place is held, or places + cost <= (eta + 1) * B.

The machine keeps a model of every session (status, key, claim, trained mark, turns) and, after
each step, checks it against the store as the server sees it (the REST list, and the columns
the REST views do not show read from the SQLite file), that places held (from the model and
from the store) stay within the bound (max((eta + 1) * B, G): an empty run admits a whole group
larger than the limit), and that each 201 or 429 was the one the rule calls for.
Claims are checked to never hand out a session another live claim holds, and every confirm and
drop to settle exactly the sessions that were still unsettled.

Two plain tests pin the scenarios that broke the old, version-counting bound: drops and
restarts with republishes never raise the number of sessions admitted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from server.store.drop_reasons import NO_TURNS
from server.store.tables import Session as SessionRow
from tests.api.api_support import ADMIN_KEY, Api, assert_error
from tests.api.conftest import app_with_own_engine

OPEN, TRAINABLE, CLAIMED = "open", "trainable", "claimed"
CONSUMED, DROPPED, EVALUATED = "consumed", "dropped", "evaluated"
# Model statuses that hold a place (a training session, not yet trained).
HOLDING = {OPEN, TRAINABLE, CLAIMED}
TEST_DROP = "dropped_by_test"
# A claim's lease: the run's (300 s), or one that has lapsed by the next call, so that whether a
# lease lapsed never depends on timing and every example replays exactly.
LAPSED_LEASE_S = 0.001
# The keys an admission may carry: none, a few group_ids, task_ids, and both (group_id wins).
KEYS = [
    {},
    {"group_id": "a"},
    {"group_id": "b"},
    {"task_id": "t"},
    {"group_id": "b", "task_id": "t"},
    {"eval": True},  # admitted even at the bound; holds no place
]


# --------------------------------------------------------------------------------------------
# the rule, restated


def group_key(group_id: str | None, task_id: str | None, group_size: int) -> tuple | None:
    if group_id is not None:
        return ("group", group_id)
    if group_size > 1 and task_id is not None:
        return ("task", task_id)
    return None


def places(keys: Iterable[tuple | None], group_size: int) -> int:
    """Places held by place-holding sessions with these keys: one a keyless session, a group
    max(group_size, its members)."""
    members = Counter(keys)
    keyless = members.pop(None, 0)
    return keyless + sum(max(group_size, count) for count in members.values())


def cost(keys: Iterable[tuple | None], key: tuple | None, group_size: int) -> int:
    if key is None or group_size <= 1:
        return 1
    members = Counter(keys)[key]
    if members == 0:
        return group_size
    return 0 if members < group_size else 1


def admitted(held: int, cost: int, limit: int) -> bool:
    return cost == 0 or held == 0 or held + cost <= limit


# --------------------------------------------------------------------------------------------
# calls that need the engine


def served(api: Api, path: str, key: str, body: dict) -> dict:
    """A call that needs the engine: it must answer 200. (A health probe that raced a publish
    used to take the engine out of rotation for 2 s, and such a call got a 503; the pool no
    longer judges a probe that overlapped a swap, and this holds it to that.)"""
    reply = api.call("POST", path, key=key, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(api: Api, key: str, max_tokens: int = 1) -> None:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    served(api, "/v1/chat/completions", key, {**request, "max_tokens": max_tokens})


def publish(api: Api, run_id: str) -> int:
    """Publish the tiny model's weights again as the run's next version; that version."""
    body = {"model_path": str(api.model_dir), "run_id": run_id}
    return served(api, "/admin/weights", ADMIN_KEY, body)["policy_version"]


# --------------------------------------------------------------------------------------------
# the model


@dataclass(eq=False)  # one object per session: compared and hashed by identity
class Modelled:
    session_id: str
    api_key: str
    group_id: str | None
    task_id: str | None
    eval: bool = False
    status: str = OPEN  # as stored: TRAINABLE with a claim_id is a lapsed claim's, not retaken
    turns: int = 0
    claim_id: str | None = None
    trained_version: int | None = None
    drop_reason: str | None = None

    @property
    def holds_place(self) -> bool:
        return not self.eval and self.status in HOLDING and self.trained_version is None


class AdmissionMachine(RuleBasedStateMachine):
    """One fresh run per example; ``api`` and ``store`` are set by the test."""

    api: Api
    store: sqlalchemy.Engine

    def __init__(self) -> None:
        super().__init__()
        self.sessions: dict[str, Modelled] = {}
        self.claims: dict[str, bool] = {}  # claim_id -> its lease has lapsed
        self.run_id = ""

    # ----------------------------------------------------------------------------------------
    # the run

    @initialize(
        batch_size=st.integers(1, 4),
        max_staleness=st.integers(0, 2),
        group_size=st.sampled_from([None, 2, 3]),
    )
    def new_run(self, batch_size: int, max_staleness: int, group_size: int | None) -> None:
        run = self.api.new_run(
            batch_size=batch_size,
            max_staleness=max_staleness,
            group_size=group_size,
            admission_wait_s=0,
        )
        self.run_id, self.version = run["id"], run["policy_version"]
        self.size = group_size or 1
        self.limit = (max_staleness + 1) * batch_size

    def key_of(self, session: Modelled) -> tuple | None:
        return group_key(session.group_id, session.task_id, self.size)

    def held_keys(self) -> list[tuple | None]:
        return [self.key_of(s) for s in self.sessions.values() if s.holds_place]

    def where(self, **fields) -> list[Modelled]:
        return [
            s
            for s in self.sessions.values()
            if all(getattr(s, name) == value for name, value in fields.items())
        ]

    def of_claim(self, claim_id: str) -> list[Modelled]:
        return self.where(claim_id=claim_id)

    def held_by(self, claim_id: str) -> list[Modelled]:
        """The claim's sessions it can still settle: claimed, or lapsed and not retaken."""
        return [s for s in self.of_claim(claim_id) if s.status in {CLAIMED, TRAINABLE}]

    # ----------------------------------------------------------------------------------------
    # agents

    @rule(key=st.sampled_from(KEYS))
    def admit(self, key: dict) -> None:
        keys = self.held_keys()
        held = places(keys, self.size)
        price = cost(keys, group_key(key.get("group_id"), key.get("task_id"), self.size), self.size)
        expected = key.get("eval", False) or admitted(held, price, self.limit)
        reply = self.api.call("POST", "/rl/sessions", json={"run_id": self.run_id, **key})
        if reply.status_code == 201:
            assert expected, f"over-admission: {held} places held + {price} > {self.limit}"
            created = reply.json()
            self.sessions[created["session_id"]] = Modelled(
                created["session_id"],
                created["api_key"],
                key.get("group_id"),
                key.get("task_id"),
                eval=key.get("eval", False),
            )
        else:
            assert_error(reply, 429, code="staleness_bound")
            assert "retry-after" in reply.headers
            assert not expected, f"false refusal: {held} places held + {price} <= {self.limit}"

    @precondition(lambda self: self.where(status=OPEN))
    @rule(data=st.data(), max_tokens=st.integers(1, 2))
    def turn(self, data: st.DataObject, max_tokens: int) -> None:
        self.chat(data.draw(st.sampled_from(self.where(status=OPEN))), max_tokens)

    @precondition(lambda self: self.where(status=OPEN))
    @rule(data=st.data(), turn_first=st.booleans())
    def end(self, data: st.DataObject, turn_first: bool) -> None:
        """Reward and end a session (it becomes trainable), after a last turn or not."""
        session = data.draw(st.sampled_from(self.where(status=OPEN)))
        if turn_first:
            self.chat(session, max_tokens=1)
        path = f"/rl/sessions/{session.session_id}"
        self.api.ok("POST", f"{path}/reward", json={"reward": 1.0})
        session.status = EVALUATED if session.eval else TRAINABLE
        assert self.api.ok("POST", f"{path}/end")["status"] == session.status

    def chat(self, session: Modelled, max_tokens: int) -> None:
        chat(self.api, session.api_key, max_tokens)
        session.turns += 1

    # ----------------------------------------------------------------------------------------
    # the trainer

    @precondition(lambda self: self.where(status=TRAINABLE) or self.lapsed())
    @rule(max_sessions=st.integers(1, 4), lapsed=st.booleans())
    def claim(self, max_sessions: int, lapsed: bool) -> None:
        # Before it chooses, a claim returns lapsed claims' sessions to the pool (they keep
        # their claim's id) and drops the trainable sessions without a turn.
        for session in self.lapsed():
            session.status = TRAINABLE
        for session in self.where(status=TRAINABLE, turns=0):
            session.status, session.drop_reason, session.claim_id = DROPPED, NO_TURNS, None
        ready = self.where(status=TRAINABLE)
        body: dict = {"max_sessions": max_sessions}
        if lapsed:
            body["lease_s"] = LAPSED_LEASE_S
        reply = self.api.ok("POST", f"/rl/runs/{self.run_id}/claims", json=body)
        taken = [self.sessions[s["session_id"]] for s in reply["sessions"]]
        for session in taken:  # never one that a live claim holds
            assert session.status == TRAINABLE and session.turns > 0, f"claimed twice: {session}"
        keys = {self.key_of(s) for s in taken}
        assert len(taken) <= max_sessions or len(keys) == 1, "only a first group goes whole"
        for key in keys - {None}:  # groups are never split
            whole = {s.session_id for s in ready if self.key_of(s) == key}
            assert whole <= {s.session_id for s in taken}, key
        if self.claimable(ready):
            assert taken, "a claim took nothing while a group was ready"
        for session in taken:
            session.status, session.claim_id = CLAIMED, reply["claim_id"]
        self.claims[reply["claim_id"]] = lapsed

    def lapsed(self) -> list[Modelled]:
        """Sessions still claimed by a claim whose lease has lapsed."""
        return [s for s in self.where(status=CLAIMED) if self.claims[s.claim_id]]

    def claimable(self, ready: list[Modelled]) -> bool:
        """Is a whole group (or a keyless session) among these trainable sessions? Group
        timeouts are the default 600 s, so a short group is never claimable here."""
        if self.size <= 1:
            return bool(ready)
        members = Counter(self.key_of(s) for s in ready)
        return members.pop(None, 0) > 0 or any(n >= self.size for n in members.values())

    @precondition(lambda self: any(self.held_by(c) for c in self.claims))
    @rule(data=st.data())
    def trained(self, data: st.DataObject) -> None:
        """A step trained the claim and published the run's version."""
        claim_id = data.draw(st.sampled_from(list(self.claims)))
        path, body = f"/rl/claims/{claim_id}/trained", {"version": self.version}
        if not self.of_claim(claim_id):  # released, retaken or empty: no session carries it
            reply = self.api.call("POST", path, json=body)
            assert reply.status_code == 404, reply.text
            assert reply.json()["error"]["code"] == "claim_not_found"
            return
        reply = self.api.ok("POST", path, json=body)
        held = self.held_by(claim_id)
        for session in held:  # a session keeps the version that first trained it
            if session.trained_version is None:
                session.trained_version = self.version
        assert reply["trained"] == len(held)

    @precondition(lambda self: any(s.claim_id for s in self.sessions.values()))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """Drop some of a claim's sessions (held, or settled already) before its confirm."""
        # In the order the claims were made (ids are random): an example replays the same.
        claim_id = data.draw(st.sampled_from([c for c in self.claims if self.of_claim(c)]))
        named = data.draw(st.lists(st.sampled_from(self.of_claim(claim_id)), min_size=1))
        reply = self.api.ok(
            "POST",
            f"/rl/claims/{claim_id}/drop",
            json={"dropped": {s.session_id: TEST_DROP for s in named}},
        )
        newly = {s.session_id: s for s in named if s in self.held_by(claim_id)}
        for session in newly.values():
            session.status, session.drop_reason = DROPPED, TEST_DROP
        assert (reply["dropped"], reply["held"]) == (
            len(newly),
            len(self.where(claim_id=claim_id, status=CLAIMED)),
        ), "a drop settles exactly the named sessions still unsettled, once"

    @precondition(lambda self: any(self.held_by(c) for c in self.claims))
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        claim_id = data.draw(st.sampled_from(list(self.claims)))
        ours = self.of_claim(claim_id)
        named = data.draw(st.lists(st.sampled_from(ours), unique=True)) if ours else []
        body = {"dropped": {s.session_id: TEST_DROP for s in named}} if named else None
        reply = self.api.ok("POST", f"/rl/claims/{claim_id}/confirm", json=body)
        held = self.held_by(claim_id)
        newly_dropped = [s for s in held if s in named]
        for session in held:
            if session in named:
                session.status, session.drop_reason = DROPPED, TEST_DROP
            else:
                session.status = CONSUMED
        settled = [s for s in self.of_claim(claim_id) if s.status in {CONSUMED, DROPPED}]
        assert (reply["consumed"], reply["dropped"], reply["settled"]) == (
            len(held) - len(newly_dropped),
            len(newly_dropped),
            len(settled),
        ), "a confirm settles exactly the claim's unsettled sessions, once"

    @precondition(lambda self: self.claims)  # a trainer publishes once it has claimed
    @rule()
    def publish(self) -> None:
        self.version += 1
        assert publish(self.api, self.run_id) == self.version

    @precondition(lambda self: any(self.held_by(c) for c in self.claims))
    @rule()
    def restart(self) -> None:
        """A restarted trainer releases every claim it had not confirmed."""
        for claim_id in self.claims:
            held = self.held_by(claim_id)
            reply = self.api.ok("POST", f"/rl/claims/{claim_id}/release")
            assert reply["released"] == len(held)
            for session in held:  # a trained mark stays: its place was freed once
                session.status, session.claim_id = TRAINABLE, None

    # ----------------------------------------------------------------------------------------
    # after every step

    @invariant()
    def agrees_with_the_store(self) -> None:
        if not self.run_id:
            return
        listed = self.api.ok("GET", "/rl/sessions", params={"run_id": self.run_id, "limit": 1000})
        shown = {
            s["session_id"]: (s["status"], s["turn_count"], s["drop_reason"], s["eval"])
            for s in listed
        }
        assert shown == {
            s.session_id: (s.status, s.turns, s.drop_reason, s.eval) for s in self.sessions.values()
        }
        stored = self.stored_rows()
        assert {row.id: (row.status, row.claim_id, row.trained_version) for row in stored} == {
            s.session_id: (s.status, s.claim_id, s.trained_version) for s in self.sessions.values()
        }

        from_model = places(self.held_keys(), self.size)
        from_store = places(
            (
                group_key(row.group_id, row.task_id, self.size)
                for row in stored
                if row.status in {"open", "ended", TRAINABLE, CLAIMED}
                and not row.eval
                and row.trained_version is None
            ),
            self.size,
        )
        assert from_model == from_store
        # A run holding no place admits a whole group even when it is larger than the limit
        # (``admits``), so with group_size > (eta + 1) * B the bound is the group's size.
        assert from_store <= max(self.limit, self.size), (from_store, self.limit, self.size)

    def stored_rows(self) -> list[sqlalchemy.Row]:
        columns = (
            SessionRow.id,
            SessionRow.status,
            SessionRow.group_id,
            SessionRow.task_id,
            SessionRow.eval,
            SessionRow.claim_id,
            SessionRow.trained_version,
        )
        query = sqlalchemy.select(*columns).where(SessionRow.run_id == self.run_id)
        with self.store.connect() as db:
            return list(db.execute(query))


# --------------------------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def api(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Api]:
    """An app with an engine of its own: this module publishes weights, which the shared
    engine's other apps (on fresh stores at version 0) would take it out of rotation for."""
    with app_with_own_engine(tiny_model_dir, tmp_path_factory.mktemp("admission")) as (app, _):
        yield app


@pytest.fixture(scope="module")
def store(api: Api) -> Iterator[sqlalchemy.Engine]:
    """The app's SQLite store, read directly (the REST views do not show claim ids and trained
    marks)."""
    engine = sqlalchemy.create_engine(api.http.app.state.ctx.settings.database_url)
    yield engine
    engine.dispose()


def test_random_traffic_never_breaks_the_bound(api: Api, store: sqlalchemy.Engine) -> None:
    machine = type("Machine", (AdmissionMachine,), {"api": api, "store": store})
    run_state_machine_as_test(
        machine,
        # No shrinking: each replay is dozens of HTTP calls, and shrinking a failure ran past
        # the suite's 300 s timeout, which would lose the report. The failing steps print whole.
        settings=settings(
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            max_examples=20,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def trainable_session(api: Api, run_id: str) -> str:
    """A session admitted, with one turn, rewarded and ended; its id."""
    session = api.new_session(run_id)
    chat(api, session["api_key"])
    path = f"/rl/sessions/{session['session_id']}"
    api.ok("POST", f"{path}/reward", json={"reward": 1.0})
    assert api.ok("POST", f"{path}/end")["status"] == TRAINABLE
    return session["session_id"]


def refused(api: Api, run_id: str) -> bool:
    reply = api.call("POST", "/rl/sessions", json={"run_id": run_id})
    if reply.status_code == 201:
        return False
    assert_error(reply, 429, code="staleness_bound")
    return True


def held_places(store: sqlalchemy.Engine, run_id: str) -> int:
    """Places the run's sessions hold, from the store (no group size: one per session)."""
    query = sqlalchemy.select(sqlalchemy.func.count()).where(
        SessionRow.run_id == run_id,
        SessionRow.status.in_(["open", "ended", TRAINABLE, CLAIMED]),
        SessionRow.eval.is_(False),
        SessionRow.trained_version.is_(None),
    )
    with store.connect() as db:
        return int(db.scalar(query) or 0)


def claimed_ids(api: Api, run_id: str) -> tuple[str, set[str]]:
    claim = api.ok("POST", f"/rl/runs/{run_id}/claims", json={"max_sessions": 10})
    return claim["claim_id"], {s["session_id"] for s in claim["sessions"]}


def test_drops_never_raise_the_limit(api: Api, store: sqlalchemy.Engine) -> None:
    """B=2, eta=0: two sessions fill the run; once claimed and dropped they free exactly their
    two places, and publishing versions frees none (the old bound, counted against versions,
    let every drop and every publish admit more for good)."""
    run_id = api.new_run(batch_size=2, max_staleness=0, admission_wait_s=0)["id"]
    first = {trainable_session(api, run_id) for _ in range(2)}
    assert refused(api, run_id)
    claim_id, taken = claimed_ids(api, run_id)
    assert taken == first
    dropped = api.ok(
        "POST", f"/rl/claims/{claim_id}/drop", json={"dropped": dict.fromkeys(first, TEST_DROP)}
    )
    assert dropped["dropped"] == 2 and held_places(store, run_id) == 0
    publish(api, run_id)

    assert [refused(api, run_id) for _ in range(3)] == [False, False, True]
    for _ in range(3):
        publish(api, run_id)
        assert refused(api, run_id)
    assert held_places(store, run_id) == 2


def test_a_restart_does_not_raise_the_limit(api: Api, store: sqlalchemy.Engine) -> None:
    """B=2, eta=0: two sessions claimed and marked trained free their places; a trainer
    restart releases them (claimable again, still marked) and a republish follows: the places
    held stay as they were, so exactly two more sessions are admitted."""
    run_id = api.new_run(batch_size=2, max_staleness=0, admission_wait_s=0)["id"]
    sessions = {trainable_session(api, run_id) for _ in range(2)}
    claim_id, taken = claimed_ids(api, run_id)
    assert taken == sessions
    version = publish(api, run_id)
    trained = api.ok("POST", f"/rl/claims/{claim_id}/trained", json={"version": version})
    assert trained["trained"] == 2 and held_places(store, run_id) == 0

    assert api.ok("POST", f"/rl/claims/{claim_id}/release")["released"] == 2
    publish(api, run_id)
    assert held_places(store, run_id) == 0
    again, retaken = claimed_ids(api, run_id)
    assert retaken == sessions
    # Marked again by the step that retrains them, they keep the version that first trained
    # them: their places were freed once.
    later = publish(api, run_id)
    assert api.ok("POST", f"/rl/claims/{again}/trained", json={"version": later})["trained"] == 2
    query = sqlalchemy.select(SessionRow.trained_version).where(SessionRow.run_id == run_id)
    with store.connect() as db:
        assert set(db.scalars(query)) == {version}

    assert [refused(api, run_id) for _ in range(3)] == [False, False, True]
    assert held_places(store, run_id) == 2
