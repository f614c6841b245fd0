"""Claims that never get stuck, groups kept whole, lease renewal, dropping sessions of a claim
and confirming with drops, when a session becomes trainable, the run's config in the claim, its
sampling temperature and alternatives, against a real ``proxrl serve``.

Claim, group, lease and admission tests run on SQLite and on PostgreSQL; reward, temperature and
alternative tests on SQLite (the store logic they touch is the same on both). Every test makes
a run of its own, so one module-scoped server per backend serves them all. Deadlines are swept
every 0.2 s; group and lease timeouts are set to about a second through the run's config.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from server.store import drop_reasons
from tests.support import ProxyProcess, RestClient

ADMIN_KEY = ProxyProcess.ADMIN_KEY
SWEEP_INTERVAL_S = 0.2
GROUP_TIMEOUT_S = 1.0
BOTH = pytest.mark.parametrize("proxy", ["sqlite", "postgres"], indirect=True, scope="module")
SQLITE = pytest.mark.parametrize("proxy", ["sqlite"], indirect=True, scope="module")


# --------------------------------------------------------------------------------------------
# helpers


@dataclass
class Proxy(RestClient):
    process: ProxyProcess
    http: httpx.Client
    model_dir: Path

    def reward(self, session_id: str, value: float, completion_id: str | None = None) -> dict:
        body: dict = {"reward": value}
        if completion_id is not None:
            body["completion_id"] = completion_id
        return self.ok("POST", f"/rl/sessions/{session_id}/reward", json=body)

    def trainable_session(self, run_id: str, **fields) -> str:
        """A session with one model call, rewarded and ended; its id."""
        session = self.new_session(run_id, **fields)
        chat(session)
        self.reward(session["session_id"], 1.0)
        assert self.end(session["session_id"])["status"] == "trainable"
        return session["session_id"]

    def claim(self, run_id: str, max_sessions: int = 100, **body) -> dict:
        body = {"max_sessions": max_sessions, **body}
        return self.ok("POST", f"/rl/runs/{run_id}/claims", json=body)

    def claimed_ids(self, run_id: str, max_sessions: int = 100, **body) -> set[str]:
        return {s["session_id"] for s in self.claim(run_id, max_sessions, **body)["sessions"]}

    def confirm(self, claim_id: str, dropped: dict[str, str] | None = None) -> dict:
        body = None if dropped is None else {"dropped": dropped}
        return self.ok("POST", f"/rl/claims/{claim_id}/confirm", json=body)

    def drop(self, claim_id: str, dropped: dict[str, str]) -> dict:
        return self.ok("POST", f"/rl/claims/{claim_id}/drop", json={"dropped": dropped})

    def renew(self, *claim_ids: str, lease_s: float | None = None) -> dict:
        body = {"claim_ids": list(claim_ids), "lease_s": lease_s}
        return self.ok("POST", "/rl/claims/renew", json=body)

    def statuses(self, session_ids) -> dict[str, str]:
        return {sid: self.session(sid)["status"] for sid in session_ids}


def openai_for(session: dict) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def chat(session: dict, text: str = "hi", **options):
    """One chat turn in ``session`` through the openai SDK; the ChatCompletion."""
    with openai_for(session) as client:
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            **{"max_tokens": 4, **options},
        )


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def moment(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


def wait_past_group_timeout() -> None:
    time.sleep(GROUP_TIMEOUT_S + 0.3)


# --------------------------------------------------------------------------------------------
# the server under test


@pytest.fixture(scope="module")
def proxy(request, tiny_model_dir, tmp_path_factory):
    """``proxrl serve`` on SQLite or on a fresh PostgreSQL database (the test's parameter)."""
    backend = request.param
    data_dir = tmp_path_factory.mktemp(f"claims-{backend}")
    extra = ["--sweep-interval-s", str(SWEEP_INTERVAL_S)]
    if backend == "postgres":
        extra += ["--db", request.getfixturevalue("postgres").new_database()]
    with (
        ProxyProcess(tiny_model_dir, data_dir, *extra) as process,
        httpx.Client(base_url=process.url, timeout=60) as http,
    ):
        yield Proxy(process, http, tiny_model_dir)


# --------------------------------------------------------------------------------------------
# sessions without turns


@BOTH
def test_a_session_without_a_turn_is_dropped_at_the_claim_with_its_reason(proxy):
    """A trainable session that never called the model is dropped by the next claim (it has
    nothing to train and used to crash the trainer); the reason shows in every view of it."""
    run = proxy.new_run()
    empty = proxy.new_session(run["id"])["session_id"]
    proxy.reward(empty, 1.0)
    assert proxy.end(empty)["status"] == "trainable"
    full = proxy.trainable_session(run["id"])

    assert proxy.claimed_ids(run["id"]) == {full}
    shown = proxy.session(empty)
    assert shown["status"] == "dropped" and shown["drop_reason"] == drop_reasons.NO_TURNS
    assert proxy.session(full)["drop_reason"] is None
    assert proxy.claimed_ids(run["id"]) == set()

    listed = proxy.ok("GET", "/rl/sessions", params={"run_id": run["id"], "status": "dropped"})
    assert [(s["session_id"], s["drop_reason"]) for s in listed] == [(empty, drop_reasons.NO_TURNS)]
    page = proxy.ok("GET", "/admin/api/sessions", params={"run_id": run["id"]})
    reasons = {s["session_id"]: s["drop_reason"] for s in page["items"]}
    assert reasons == {empty: drop_reasons.NO_TURNS, full: None}


@SQLITE
def test_the_dashboard_shows_the_drop_reason(proxy):
    run = proxy.new_run()
    empty = proxy.new_session(run["id"])["session_id"]
    proxy.reward(empty, 1.0)
    proxy.end(empty)
    proxy.claim(run["id"])
    login = proxy.http.post("/admin/login", data={"key": ADMIN_KEY}, follow_redirects=False)
    cookies = {"proxrl_admin": login.cookies["proxrl_admin"]}
    with httpx.Client(base_url=proxy.url, cookies=cookies) as browser:
        page = browser.get(f"/admin/sessions/{empty}").text
        assert drop_reasons.NO_TURNS in page
        listing = browser.get("/admin/sessions", params={"run_id": run["id"]}).text
        assert f'title="{drop_reasons.NO_TURNS}"' in listing and ">no_turns<" in listing


# --------------------------------------------------------------------------------------------
# groups that never complete


@BOTH
def test_task_groups_keyless_sessions_and_short_groups_are_claimed_after_the_timeout(proxy):
    """group_size 3, on_incomplete_group=train: a full group and a session without a key are
    claimed at once; a task-only group of two waits for group_timeout_s, then is claimed whole
    in one claim."""
    run = proxy.new_run(group_size=3, group_timeout_s=GROUP_TIMEOUT_S)
    full = {proxy.trainable_session(run["id"], group_id="g") for _ in range(3)}
    short = {proxy.trainable_session(run["id"], task_id="t") for _ in range(2)}
    alone = proxy.trainable_session(run["id"])
    same_name = proxy.trainable_session(run["id"], group_id="t")  # not in task "t"'s group

    assert proxy.claimed_ids(run["id"]) == full | {alone}
    wait_past_group_timeout()
    claim = proxy.claim(run["id"])
    assert {s["session_id"] for s in claim["sessions"]} == short | {same_name}
    assert {s["task_id"] for s in claim["sessions"] if s["session_id"] in short} == {"t"}


@BOTH
def test_short_groups_and_keyless_sessions_are_dropped_when_the_run_says_so(proxy):
    """on_incomplete_group=drop: a session without a key is dropped at once (no_group), a
    short group after group_timeout_s (incomplete_group, saying how many of how many)."""
    run = proxy.new_run(group_size=3, group_timeout_s=GROUP_TIMEOUT_S, on_incomplete_group="drop")
    short = [proxy.trainable_session(run["id"], task_id="t") for _ in range(2)]
    alone = proxy.trainable_session(run["id"])

    assert proxy.claimed_ids(run["id"]) == set()
    dropped = proxy.session(alone)
    assert dropped["status"] == "dropped"
    assert dropped["drop_reason"] == drop_reasons.no_group(3)
    assert proxy.statuses(short) == dict.fromkeys(short, "trainable")

    wait_past_group_timeout()
    assert proxy.claimed_ids(run["id"]) == set()
    for session_id in short:
        reason = proxy.session(session_id)["drop_reason"]
        assert reason.startswith("incomplete_group: task 't' had 2 of group_size 3 sessions")
        assert f"(group_timeout_s {GROUP_TIMEOUT_S:g} s)" in reason
    assert proxy.ok("GET", f"/rl/runs/{run['id']}")["sessions"] == {"dropped": 3}


@BOTH
def test_a_group_that_lost_a_member_to_the_reward_deadline_is_claimed_after_the_timeout(proxy):
    """One member of a pair never gets its reward and is dropped at the reward deadline. The
    other used to wait forever for it (as it still does without a group_timeout_s); with one,
    it is claimed alone once the timeout has passed."""
    run = proxy.new_run(group_size=2, group_timeout_s=None)
    kept = proxy.trainable_session(run["id"], group_id="pair")
    lost = proxy.new_session(run["id"], group_id="pair")
    chat(lost)
    proxy.end(lost["session_id"])
    proxy.patch_run(run["id"], reward_timeout_s=0.3, on_missing_reward="drop")

    gone = proxy.wait_for_status(lost["session_id"], "dropped")
    assert gone["drop_reason"] == drop_reasons.no_reward(0.3)
    assert proxy.claimed_ids(run["id"]) == set()
    proxy.patch_run(run["id"], group_timeout_s=GROUP_TIMEOUT_S)
    wait_past_group_timeout()
    assert proxy.claimed_ids(run["id"]) == {kept}


@BOTH
def test_concurrent_group_claims_never_split_a_group_nor_share_a_session(proxy):
    """Two trainers claiming groups of two at once: each gets whole groups, none in common;
    claiming on takes every group exactly once."""
    run = proxy.new_run(group_size=2)
    groups = [
        {proxy.trainable_session(run["id"], group_id=f"g{i}") for _ in range(2)} for i in range(6)
    ]
    path = f"/rl/runs/{run['id']}/claims"
    body = {"max_sessions": 4}
    with (
        httpx.Client(base_url=proxy.url, timeout=60, headers=proxy.process.admin) as http,
        ThreadPoolExecutor(2) as pool,
    ):
        replies = list(pool.map(lambda _: http.post(path, json=body), range(2)))
    taken: list[set[str]] = []
    for reply in replies:
        assert reply.status_code == 200, reply.text
        taken.append({s["session_id"] for s in reply.json()["sessions"]})
    assert taken[0].isdisjoint(taken[1])
    while claimed := proxy.claimed_ids(run["id"], max_sessions=4):
        taken.append(claimed)
    everything = set().union(*taken)
    assert everything == set().union(*groups)
    for ids in taken:
        assert all(members <= ids or members.isdisjoint(ids) for members in groups)
    assert sum(len(ids) for ids in taken) == len(everything)


@BOTH
def test_without_a_group_size_a_group_id_is_claimed_whole_and_task_sessions_one_by_one(proxy):
    """No group_size: a group_id's trainable sessions all come in one claim, even beyond
    max_sessions (a batch boundary never cuts a GRPO group); sessions with only a task_id are
    not grouped (an online task's sessions would pile up), so they come one by one."""
    run = proxy.new_run()
    group = {proxy.trainable_session(run["id"], group_id="g", task_id="t") for _ in range(3)}
    tasks = [proxy.trainable_session(run["id"], task_id="t") for _ in range(3)]
    pair = {proxy.trainable_session(run["id"], group_id="h") for _ in range(2)}

    assert proxy.claimed_ids(run["id"], max_sessions=2) == group
    assert proxy.claimed_ids(run["id"], max_sessions=2) == set(tasks[:2])
    assert proxy.claimed_ids(run["id"], max_sessions=2, group_size=1) == {tasks[2]}
    assert proxy.claimed_ids(run["id"], max_sessions=1, group_size=1) == pair


@BOTH
def test_an_incomplete_group_no_longer_deadlocks_admission(proxy):
    """At its admission bound with a group waiting for its second member, a run used to admit
    no other group forever. Now, after group_timeout_s, the trainer claims it as it is,
    confirms, and a new group is admitted."""
    run = proxy.new_run(
        batch_size=2,
        max_staleness=0,
        group_size=2,
        group_timeout_s=GROUP_TIMEOUT_S,
        admission_wait_s=0,
    )
    waiting = {proxy.trainable_session(run["id"], group_id="a")}  # holds the group's 2 places
    refused = proxy.call("POST", "/rl/sessions", json={"run_id": run["id"], "group_id": "b"})
    assert error_of(refused, 429)["code"] == "staleness_bound"
    assert proxy.claimed_ids(run["id"]) == set()

    wait_past_group_timeout()
    claim = proxy.claim(run["id"], max_sessions=2)
    assert {s["session_id"] for s in claim["sessions"]} == waiting
    assert proxy.confirm(claim["claim_id"])["settled"] == 1
    assert proxy.new_session(run["id"], group_id="b")["status"] == "open"


# --------------------------------------------------------------------------------------------
# leases: renew, lapse, confirm, release


@BOTH
def test_a_renewed_lease_is_never_handed_to_a_second_claim(proxy):
    """A lease of 1 s held for 2 s by renewing it: a second trainer claiming all along gets
    nothing, and the first confirms every session."""
    run = proxy.new_run()
    ids = {proxy.trainable_session(run["id"]) for _ in range(2)}
    held = proxy.claim(run["id"], lease_s=1.0)
    assert {s["session_id"] for s in held["sessions"]} == ids
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        time.sleep(0.3)
        renewed = proxy.renew(held["claim_id"], lease_s=1.0)
        assert renewed["held"] == {held["claim_id"]: 2}
        assert moment(renewed["expires_at"]) > moment(held["expires_at"])
        assert proxy.claimed_ids(run["id"]) == set()
    assert proxy.confirm(held["claim_id"]) == {
        "claim_id": held["claim_id"],
        "consumed": 2,
        "dropped": 0,
        "settled": 2,
    }


@BOTH
def test_renewing_without_a_lease_uses_the_runs_and_unknown_claims_hold_nothing(proxy):
    run = proxy.new_run(claim_lease_s=50)
    proxy.trainable_session(run["id"])
    claim = proxy.claim(run["id"], lease_s=1)
    renewed = proxy.renew(claim["claim_id"], "claim-unknown")
    assert renewed["held"] == {claim["claim_id"]: 1, "claim-unknown": 0}
    ahead = moment(renewed["expires_at"]) - moment(claim["expires_at"])
    assert ahead.total_seconds() > 40  # the run's 50 s from now, not 1
    assert proxy.renew("claim-unknown") == {"held": {"claim-unknown": 0}, "expires_at": None}
    too_many = {"claim_ids": [f"c{i}" for i in range(10_001)]}
    assert error_of(proxy.call("POST", "/rl/claims/renew", json=too_many), 422)
    bad_lease = {"claim_ids": ["c"], "lease_s": 0}
    assert error_of(proxy.call("POST", "/rl/claims/renew", json=bad_lease), 422)["param"] == (
        "lease_s"
    )


def lapse_into_the_pool(proxy: Proxy, run_id: str) -> None:
    """Let every lease of the run run out and return its sessions to the pool, by a claim that
    cannot take them (group_size 3 of pairs that may wait 600 s)."""
    time.sleep(0.5)
    assert proxy.claimed_ids(run_id, group_size=3) == set()


@BOTH
def test_a_lapsed_claim_no_one_retook_can_be_renewed_and_confirmed(proxy):
    """A lease ran out and the sessions went back to the pool, but no other claim took them:
    the owner renews them back (held == its size) and confirms all of them."""
    run = proxy.new_run()
    pair = {proxy.trainable_session(run["id"], group_id="p") for _ in range(2)}
    claim = proxy.claim(run["id"], lease_s=0.3)
    lapse_into_the_pool(proxy, run["id"])
    assert proxy.statuses(pair) == dict.fromkeys(pair, "trainable")

    assert proxy.renew(claim["claim_id"], lease_s=60)["held"] == {claim["claim_id"]: 2}
    assert proxy.statuses(pair) == dict.fromkeys(pair, "claimed")
    assert proxy.claimed_ids(run["id"]) == set()
    assert proxy.confirm(claim["claim_id"])["settled"] == 2


@BOTH
def test_a_lapsed_claim_can_be_confirmed_without_renewing(proxy):
    run = proxy.new_run()
    pair = {proxy.trainable_session(run["id"], group_id="p") for _ in range(2)}
    claim = proxy.claim(run["id"], lease_s=0.3)
    lapse_into_the_pool(proxy, run["id"])
    confirmed = proxy.confirm(claim["claim_id"])
    assert (confirmed["consumed"], confirmed["settled"]) == (2, 2)
    assert proxy.statuses(pair) == dict.fromkeys(pair, "consumed")


@BOTH
def test_a_lapsed_claim_partly_retaken_by_another_settles_fewer(proxy):
    """Another claim took one of three lapsed sessions: the owner's renewal holds two, its
    confirmation settles two (fewer than it was given), and the session the other claim took
    is that claim's to confirm."""
    run = proxy.new_run()
    ids = {proxy.trainable_session(run["id"]) for _ in range(3)}
    first = proxy.claim(run["id"], lease_s=0.3)
    time.sleep(0.5)
    second = proxy.claim(run["id"], max_sessions=1)
    (retaken,) = [s["session_id"] for s in second["sessions"]]
    assert retaken in ids

    assert proxy.renew(first["claim_id"], lease_s=60)["held"] == {first["claim_id"]: 2}
    settled = proxy.confirm(first["claim_id"])
    assert (settled["consumed"], settled["settled"]) == (2, 2)
    assert proxy.session(retaken)["status"] == "claimed"
    assert proxy.confirm(second["claim_id"])["settled"] == 1


@BOTH
def test_a_lapsed_claim_wholly_retaken_holds_nothing(proxy):
    run = proxy.new_run()
    ids = {proxy.trainable_session(run["id"]) for _ in range(2)}
    first = proxy.claim(run["id"], lease_s=0.3)
    time.sleep(0.5)
    assert proxy.claimed_ids(run["id"]) == ids
    assert proxy.renew(first["claim_id"])["held"] == {first["claim_id"]: 0}
    assert proxy.confirm(first["claim_id"]) == {
        "claim_id": first["claim_id"],
        "consumed": 0,
        "dropped": 0,
        "settled": 0,
    }


@BOTH
def test_confirm_drops_the_named_sessions_with_their_reasons_and_is_idempotent(proxy):
    run = proxy.new_run()
    ids = sorted(proxy.trainable_session(run["id"]) for _ in range(3))
    claim = proxy.claim(run["id"])
    reason = "stale: every token is more than max_staleness versions old"
    first = proxy.confirm(claim["claim_id"], {ids[0]: reason})
    assert first == {"claim_id": claim["claim_id"], "consumed": 2, "dropped": 1, "settled": 3}
    shown = proxy.session(ids[0])
    assert (shown["status"], shown["drop_reason"]) == ("dropped", reason)
    assert proxy.statuses(ids[1:]) == dict.fromkeys(ids[1:], "consumed")

    again = proxy.confirm(claim["claim_id"], {ids[0]: reason})
    assert again == {"claim_id": claim["claim_id"], "consumed": 0, "dropped": 0, "settled": 3}
    assert proxy.confirm(claim["claim_id"])["settled"] == 3


@BOTH
def test_confirm_refuses_bad_drops_and_changes_nothing(proxy):
    run = proxy.new_run()
    (session_id,) = [proxy.trainable_session(run["id"])]
    stranger = proxy.new_session(run["id"])["session_id"]
    claim = proxy.claim(run["id"])
    path = f"/rl/claims/{claim['claim_id']}/confirm"
    for dropped, param in [
        ({session_id: ""}, f"dropped.{session_id}"),
        ({session_id: "   "}, f"dropped.{session_id}"),
        ({session_id: "x" * 501}, f"dropped.{session_id}"),
        ({session_id: 1}, f"dropped.{session_id}"),
    ]:
        reply = proxy.call("POST", path, json={"dropped": dropped})
        assert error_of(reply, 422)["param"] == param
    for outsider in ("sess-nope", stranger):
        error = error_of(proxy.call("POST", path, json={"dropped": {outsider: "x: y"}}), 422)
        assert error["code"] == "not_in_claim" and outsider in error["message"]
    assert proxy.statuses([session_id, stranger]) == {session_id: "claimed", stranger: "open"}
    assert proxy.confirm(claim["claim_id"])["settled"] == 1


@BOTH
def test_only_the_claims_own_sessions_may_be_named_and_a_retaken_one_is_left_alone(proxy):
    """A session named in dropped (drop or confirm) must carry the claim's id, or be claimed
    now by another claim of the run (it lapsed and was retaken: that claim's to settle, left
    alone). One another claim consumed, one released, one claimed in another run, an unknown
    id: 422 not_in_claim, and nothing changes."""
    run, elsewhere = proxy.new_run(), proxy.new_run()
    lapsed, kept = proxy.trainable_session(run["id"]), proxy.trainable_session(run["id"])
    first = proxy.claim(run["id"], lease_s=0.3)
    time.sleep(0.5)
    retaken = proxy.claim(run["id"], max_sessions=1)
    assert [s["session_id"] for s in retaken["sessions"]] == [lapsed]
    assert proxy.renew(first["claim_id"], lease_s=60)["held"] == {first["claim_id"]: 1}
    consumed = proxy.trainable_session(run["id"])
    other = proxy.claim(run["id"])
    assert [s["session_id"] for s in other["sessions"]] == [consumed]
    proxy.confirm(other["claim_id"])
    released = proxy.trainable_session(run["id"])
    proxy.ok("POST", f"/rl/claims/{proxy.claim(run['id'])['claim_id']}/release")
    foreign = proxy.trainable_session(elsewhere["id"])
    proxy.claim(elsewhere["id"])

    reason = "stale: too old"
    for route in ("drop", "confirm"):
        path = f"/rl/claims/{first['claim_id']}/{route}"
        for outsider in (consumed, released, foreign, "sess-nope"):
            body = {"dropped": {kept: reason, outsider: reason}}
            error = error_of(proxy.call("POST", path, json=body), 422)
            assert error["code"] == "not_in_claim" and outsider in error["message"]
            assert kept not in error["message"]
    assert proxy.statuses([kept, lapsed, consumed, released, foreign]) == {
        kept: "claimed",
        lapsed: "claimed",
        consumed: "consumed",
        released: "trainable",
        foreign: "claimed",
    }

    assert proxy.drop(first["claim_id"], {lapsed: reason}) == {
        "claim_id": first["claim_id"],
        "dropped": 0,
        "held": 1,
    }
    settled = proxy.confirm(first["claim_id"], {kept: reason, lapsed: reason})
    assert (settled["consumed"], settled["dropped"], settled["settled"]) == (0, 1, 1)
    assert proxy.statuses([kept, lapsed]) == {kept: "dropped", lapsed: "claimed"}
    assert proxy.confirm(retaken["claim_id"])["settled"] == 1


@BOTH
def test_dropping_sessions_of_a_claim_is_settled_by_its_confirm_and_idempotent(proxy):
    """Sessions dropped from a claim are dropped at once, with their reason, and stay the
    claim's: its confirm consumes the rest and counts them all as settled. Dropping again, or
    naming them in the confirm, changes nothing."""
    run = proxy.new_run()
    ids = sorted(proxy.trainable_session(run["id"]) for _ in range(4))
    claim_id = proxy.claim(run["id"])["claim_id"]
    reason = "row_too_long: 9000 tokens, max_tokens_per_row 8192"
    named = {ids[0]: reason, ids[1]: reason}

    assert proxy.drop(claim_id, named) == {"claim_id": claim_id, "dropped": 2, "held": 2}
    shown = proxy.session(ids[0])
    assert (shown["status"], shown["drop_reason"]) == ("dropped", reason)
    assert proxy.drop(claim_id, named) == {"claim_id": claim_id, "dropped": 0, "held": 2}
    assert proxy.renew(claim_id, lease_s=60)["held"] == {claim_id: 2}

    assert proxy.confirm(claim_id, named) == {
        "claim_id": claim_id,
        "consumed": 2,
        "dropped": 0,
        "settled": 4,
    }
    assert proxy.confirm(claim_id)["settled"] == 4
    assert proxy.drop(claim_id, named) == {"claim_id": claim_id, "dropped": 0, "held": 0}
    assert proxy.statuses(ids) == {
        ids[0]: "dropped",
        ids[1]: "dropped",
        ids[2]: "consumed",
        ids[3]: "consumed",
    }
    assert proxy.ok("GET", f"/rl/runs/{run['id']}")["sessions"] == {"dropped": 2, "consumed": 2}


@BOTH
def test_a_lapsed_session_can_be_dropped_from_its_claim(proxy):
    run = proxy.new_run()
    pair = sorted(proxy.trainable_session(run["id"], group_id="p") for _ in range(2))
    claim_id = proxy.claim(run["id"], lease_s=0.3)["claim_id"]
    lapse_into_the_pool(proxy, run["id"])
    dropped = proxy.drop(claim_id, {pair[0]: "stale: too old"})
    assert (dropped["dropped"], dropped["held"]) == (1, 0)
    settled = proxy.confirm(claim_id)
    assert (settled["consumed"], settled["settled"]) == (1, 2)


@BOTH
def test_drop_refuses_bad_bodies_and_changes_nothing(proxy):
    run = proxy.new_run()
    session_id = proxy.trainable_session(run["id"])
    path = f"/rl/claims/{proxy.claim(run['id'])['claim_id']}/drop"
    for body, param in [
        ({}, "dropped"),
        ({"dropped": {}}, "dropped"),
        ({"dropped": {f"s{i}": "x: y" for i in range(10_001)}}, "dropped"),
        ({"dropped": {session_id: "  "}}, f"dropped.{session_id}"),
        ({"dropped": {session_id: "x" * 501}}, f"dropped.{session_id}"),
        ({"dropped": {session_id: "x: y"}, "held": 1}, "held"),
    ]:
        assert error_of(proxy.call("POST", path, json=body), 422)["param"] == param
    assert proxy.session(session_id)["status"] == "claimed"


@BOTH
def test_dropping_from_a_claim_frees_admission_at_once(proxy):
    """At its admission bound with its sessions claimed, a run admits a waiting session as soon
    as the trainer drops one from its claim (not at its next confirm)."""
    run = proxy.new_run(batch_size=2, max_staleness=0, admission_wait_s=20)
    ids = [proxy.trainable_session(run["id"]) for _ in range(2)]
    claim_id = proxy.claim(run["id"])["claim_id"]
    drop = ("POST", f"/rl/claims/{claim_id}/drop", {"dropped": {ids[0]: "stale: too old"}})
    reply, after_drop = proxy.create_while(run["id"], drop)
    assert reply.status_code == 201, reply.text
    assert after_drop < 5.0
    assert proxy.ok("GET", f"/rl/runs/{run['id']}")["sessions"] == {
        "claimed": 1,
        "dropped": 1,
        "open": 1,
    }


@BOTH
def test_release_gives_back_a_lapsed_claim_and_clears_its_id(proxy):
    run = proxy.new_run()
    pair = {proxy.trainable_session(run["id"], group_id="p") for _ in range(2)}
    claim = proxy.claim(run["id"], lease_s=0.3)
    lapse_into_the_pool(proxy, run["id"])
    released = proxy.ok("POST", f"/rl/claims/{claim['claim_id']}/release")
    assert released == {"claim_id": claim["claim_id"], "released": 2}
    assert proxy.renew(claim["claim_id"], lease_s=60)["held"] == {claim["claim_id"]: 0}
    assert proxy.confirm(claim["claim_id"])["settled"] == 0
    assert proxy.claimed_ids(run["id"]) == pair


# --------------------------------------------------------------------------------------------
# when a session becomes trainable


def ended_with_turn_reward(proxy: Proxy, run_id: str) -> tuple[str, str]:
    """A session with one turn, that turn rewarded, ended; its id and the turn's id."""
    session = proxy.new_session(run_id)
    turn = chat(session).id
    proxy.reward(session["session_id"], 0.5, completion_id=turn)
    proxy.end(session["session_id"])
    return session["session_id"], turn


@SQLITE
def test_a_session_reward_after_turn_rewards_is_accepted_and_makes_it_trainable(proxy):
    """Per-turn rewards alone leave an ended session ended (not claimable); its session reward,
    posted afterwards, is accepted and makes it trainable."""
    run = proxy.new_run()
    session_id, turn = ended_with_turn_reward(proxy, run["id"])
    assert proxy.session(session_id)["status"] == "ended"
    assert proxy.claimed_ids(run["id"]) == set()

    rewarded = proxy.reward(session_id, 1.0)
    assert rewarded["created"] and rewarded["status"] == "trainable"
    (claimed,) = proxy.claim(run["id"])["sessions"]
    assert claimed["reward"] == 1.0
    (row,) = claimed["rows"]
    assert [(t["completion_id"], t["reward"]) for t in row["turns"]] == [(turn, 0.5)]


@SQLITE
def test_turn_rewards_make_a_session_trainable_when_the_run_says_they_suffice(proxy):
    run = proxy.new_run(turn_rewards_suffice=True)
    session_id, _ = ended_with_turn_reward(proxy, run["id"])
    assert proxy.session(session_id)["status"] == "trainable"
    assert proxy.reward(session_id, 1.0)["status"] == "trainable"  # still welcome
    (claimed,) = proxy.claim(run["id"])["sessions"]
    assert claimed["session_id"] == session_id and claimed["reward"] == 1.0


@SQLITE
def test_at_the_reward_deadline_turn_rewards_count_only_where_they_suffice(proxy):
    """Without a session reward at reward_timeout_s: dropped (drop), given the default reward
    (default), or trainable as it is once the run says turn rewards suffice."""
    dropping = proxy.new_run()
    dropped, _ = ended_with_turn_reward(proxy, dropping["id"])
    defaulting = proxy.new_run(on_missing_reward="default", default_reward=-1.0)
    defaulted, _ = ended_with_turn_reward(proxy, defaulting["id"])
    sufficing = proxy.new_run()
    sufficed, _ = ended_with_turn_reward(proxy, sufficing["id"])
    for run in (dropping, defaulting):
        proxy.patch_run(run["id"], reward_timeout_s=0.3)
    proxy.patch_run(sufficing["id"], reward_timeout_s=0.3, turn_rewards_suffice=True)

    shown = proxy.wait_for_status(dropped, "dropped")
    assert shown["drop_reason"] == drop_reasons.no_reward(0.3)
    assert proxy.wait_for_status(defaulted, "trainable")["reward"] == -1.0
    kept = proxy.wait_for_status(sufficed, "trainable")
    assert kept["reward"] is None and list(kept["rewards"].values()) == [0.5]


# --------------------------------------------------------------------------------------------
# the run's temperature, and what the claim rows say about each turn


@BOTH
def test_the_claim_carries_the_runs_config_with_every_default(proxy):
    """Each claim answers with the run's config as it acts (the trainer reads temperature,
    off_temperature and group_size from it every step), defaults and unknown keys included,
    a PATCH showing in the next claim."""
    run = proxy.new_run(temperature=0.8, lr=1e-6)
    proxy.trainable_session(run["id"])
    config = proxy.claim(run["id"])["run_config"]
    assert (config["temperature"], config["off_temperature"], config["group_size"]) == (
        0.8,
        "mask",
        None,
    )
    assert config["lr"] == 1e-6
    assert config == proxy.ok("GET", f"/rl/runs/{run['id']}")["config"]
    proxy.patch_run(run["id"], off_temperature="off_policy", group_size=2)
    config = proxy.claim(run["id"])["run_config"]
    assert (config["off_temperature"], config["group_size"]) == ("off_policy", 2)


def sampled_temperatures(proxy: Proxy, session_id: str) -> list[float]:
    return [turn["sampling"]["temperature"] for turn in proxy.session(session_id)["turns"]]


@SQLITE
def test_requests_without_a_temperature_are_sampled_at_the_runs(proxy):
    """The run's temperature applies to chat and text completions that give none, and a PATCH
    changes it for the next request; a request's own temperature (greedy too) wins."""
    run = proxy.new_run(temperature=0.7)
    session = proxy.new_session(run["id"])
    chat(session)
    chat(session, temperature=0)
    with openai_for(session) as client:
        client.completions.create(model="tiny", prompt="Once upon", max_tokens=2)
    proxy.patch_run(run["id"], temperature=1.3)
    chat(session)
    assert sampled_temperatures(proxy, session["session_id"]) == [0.7, 0.0, 0.7, 1.3]
    for value in (0, -1, 2.5, "hot"):
        reply = proxy.call(
            "PATCH", f"/rl/runs/{run['id']}", json={"config": {"temperature": value}}
        )
        assert "temperature" in error_of(reply, 422)["message"]
    assert proxy.ok("GET", f"/rl/runs/{run['id']}")["config"]["temperature"] == 1.3


def distinct_choice(contents: list[str]) -> int:
    """The first choice after 0 whose text no earlier choice's text begins (so the proxy can
    only continue that choice when its text is sent back)."""
    for index in range(1, len(contents)):
        if not any(contents[index].startswith(contents[j]) for j in range(index)):
            return index
    raise AssertionError(f"no distinct choice among {contents!r}")


@SQLITE
def test_claim_rows_flag_alternatives_and_carry_temperatures(proxy):
    """An n=3 request continued by one choice: the other two are alternatives. A request sent
    again unchanged (a retry): the first attempt is the alternative. Each turn carries the
    temperature it was sampled at; GET /rl/sessions/{id} shows the same rows."""
    run = proxy.new_run(temperature=0.8)
    question = [{"role": "user", "content": "Pick a word."}]
    branching = proxy.new_session(run["id"])
    with openai_for(branching) as client:
        fan = client.chat.completions.create(
            model="tiny", messages=question, max_tokens=8, n=3, temperature=1.2
        )
        chosen = distinct_choice([choice.message.content or "" for choice in fan.choices])
        follow = [*question, fan.choices[chosen].message.to_dict()]
        follow.append({"role": "user", "content": "Another."})
        on = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4)
    retried = proxy.new_session(run["id"])
    with openai_for(retried) as client:
        lost = client.chat.completions.create(model="tiny", messages=question, max_tokens=4)
        kept = client.chat.completions.create(
            model="tiny", messages=question, max_tokens=4, temperature=0
        )
    for session in (branching, retried):
        proxy.reward(session["session_id"], 1.0)
        proxy.end(session["session_id"])

    turns = proxy.session(branching["session_id"])["turns"]
    assert turns[3]["extends_previous"] and turns[3]["row_index"] == turns[chosen]["row_index"]
    claimed = {s["session_id"]: s for s in proxy.claim(run["id"])["sessions"]}
    assert set(claimed) == {branching["session_id"], retried["session_id"]}

    def flags(session: dict) -> dict[str, tuple]:
        rows = claimed[session["session_id"]]["rows"]
        assert rows == proxy.session(session["session_id"])["rows"]
        return {
            t["completion_id"]: (t["turn_index"], t["temperature"], t["alternative"])
            for row in rows
            for t in row["turns"]
        }

    expected = {f"{fan.id}-{i}": (i, 1.2, i != chosen) for i in range(3)}
    assert flags(branching) == {**expected, on.id: (3, 0.8, False)}
    assert flags(retried) == {lost.id: (0, 0.8, True), kept.id: (1, 0.0, False)}
