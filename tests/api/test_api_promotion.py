"""Production sessions and the promotion gate on the in-process app, each app on an engine of its
own (these tests publish weights, and a LoRA run and a full-weight run cannot share engines).

Production sessions: admitted at once at a full staleness bound and never counted by it, never
claimed, ``served`` once ended (rewarded or not, rewards still taken), refused with eval (422)
and in a group of another kind (409), shown by every reader (session view, list, run counts,
export, dashboard API). The gate: eval sessions rewarded version by version promote a version
exactly when a float64 reference of the rule says, never an evicted one; promotion by hand and
its refusals; a gate or promotion refused to a full-weight run, and a full-weight publish
refused to a gated run, in the REST error shape.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from server.store.run_adapters import RUN_ADAPTER_TTL_S
from tests.api.api_support import Api, assert_error
from tests.api.conftest import app_with_own_engine
from tests.integration.test_lora_runs import make_adapter

GATE = {"margin": 0.25, "min_eval_sessions": 2}


@pytest.fixture(scope="module")
def own(tiny_model_dir, tmp_path_factory) -> Callable:
    """A factory of apps, each on an engine of its own, with its data directory."""

    def app(name: str):
        data_dir = tmp_path_factory.mktemp(name)
        return app_with_own_engine(tiny_model_dir, data_dir), data_dir

    return app


@pytest.fixture(scope="module")
def lora_app(own):
    context, data_dir = own("promotion-lora")
    with context as (api, _):
        yield api, data_dir


def finished(api: Api, run_id: str, reward: float | None, **fields) -> dict:
    """A session with one turn, rewarded (unless None) and ended."""
    session = api.new_session(run_id, **fields)
    api.chat(session)
    if reward is not None:
        api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": reward})
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    return session


# ----- production sessions ---------------------------------------------------------------------


def test_production_sessions_are_admitted_at_the_bound_and_never_trained(lora_app):
    api, _ = lora_app
    run = api.new_run(batch_size=1, max_staleness=0, admission_wait_s=0.2)["id"]
    production = [api.new_session(run, production=True) for _ in range(3)]  # take no place
    training = finished(api, run, 1.0)  # the one place: (0 + 1) * 1
    refused = api.call("POST", "/rl/sessions", json={"run_id": run})
    assert_error(refused, 429, code="staleness_bound")
    extra = api.new_session(run, production=True)  # still admitted at once
    assert extra["status"] == "open"

    for session in production:
        api.chat(session)
    rewarded, unrewarded, open_one = (s["session_id"] for s in production)
    api.ok("POST", f"/rl/sessions/{rewarded}/reward", json={"reward": 0.5})
    for session_id in (rewarded, unrewarded):
        assert api.ok("POST", f"/rl/sessions/{session_id}/end")["status"] == "served"
    late = api.ok("POST", f"/rl/sessions/{unrewarded}/reward", json={"reward": 0.25})
    assert (late["created"], late["status"]) == (True, "served")  # recorded after the end

    claim = api.ok("POST", f"/rl/runs/{run}/claims", json={"max_sessions": 100})
    assert [s["session_id"] for s in claim["sessions"]] == [training["session_id"]]
    api.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm")
    again = api.ok("POST", f"/rl/runs/{run}/claims", json={"max_sessions": 100})
    assert again["sessions"] == []

    shown = api.session(unrewarded)
    assert (shown["status"], shown["production"], shown["eval"]) == ("served", True, False)
    assert shown["rewards"] == {"session": 0.25} and len(shown["turns"]) == 1
    assert api.session(training["session_id"])["production"] is False
    counts = api.ok("GET", f"/rl/runs/{run}")["sessions"]
    assert counts == {"consumed": 1, "served": 2, "open": 2}
    listed = api.ok("GET", "/rl/sessions", params={"run_id": run, "status": "served"})
    assert {s["session_id"] for s in listed} == {rewarded, unrewarded}
    assert all(s["production"] for s in listed)
    page = api.ok("GET", "/admin/api/sessions", params={"run_id": run, "status": "served"})
    assert {s["session_id"] for s in page["items"]} == {rewarded, unrewarded}
    assert all(s["production"] for s in page["items"])
    assert api.ok("GET", f"/admin/api/sessions/{open_one}")["production"] is True
    page = api.call("GET", f"/admin/sessions/{unrewarded}")
    assert page.status_code == 200 and 'class="pill production"' in page.text
    listing = api.call("GET", "/admin/sessions", params={"run_id": run, "status": "served"})
    assert listing.status_code == 200 and listing.text.count('class="pill production"') == 2
    exported = api.call("GET", f"/rl/runs/{run}/export", params={"status": "all"})
    assert exported.status_code == 200, exported.text
    records = {r["session_id"]: r for r in map(json.loads, exported.text.splitlines())}
    assert len(records) == 5
    assert {sid for sid, r in records.items() if r["production"]} == {
        rewarded,
        unrewarded,
        open_one,
        extra["session_id"],
    }
    assert records[unrewarded]["status"] == "served"
    assert records[training["session_id"]]["production"] is False


def test_a_session_is_eval_or_production_and_a_group_holds_one_kind(lora_app):
    api, _ = lora_app
    run = api.new_run()["id"]
    both = api.call("POST", "/rl/sessions", json={"run_id": run, "eval": True, "production": True})
    assert_error(both, 422)
    assert_error(api.call("POST", "/rl/sessions", json={"run_id": run, "production": 1}), 422)
    api.new_session(run, group_id="g-train")
    api.new_session(run, group_id="g-eval", eval=True)
    api.new_session(run, group_id="g-prod", production=True)
    for group_id, kind in [
        ("g-train", {"production": True}),
        ("g-eval", {"production": True}),
        ("g-prod", {}),
        ("g-prod", {"eval": True}),
    ]:
        reply = api.call("POST", "/rl/sessions", json={"run_id": run, "group_id": group_id, **kind})
        error = assert_error(reply, 409, code="group_mixes_eval")
        assert error["param"] == "group_id" and group_id in error["message"]
    api.new_session(run, group_id="g-prod", production=True)  # the same kind joins


# ----- the promotion gate ----------------------------------------------------------------------


def promoted(api: Api, run_id: str) -> int | None:
    gate = api.ok("GET", f"/rl/runs/{run_id}")["promotion"]
    return None if gate is None else gate["promoted_version"]


def reference(promoted: int, scores: dict[int, list[float]], evicted: set[int]) -> int:
    """The rule in float64, from its statement (docs/operations/lora-runs.md): the newest
    version above the promoted one, not evicted, with min_eval_sessions scores whose mean is at
    least the promoted version's mean + margin (any mean, where that one has no score)."""
    bar = np.mean(scores[promoted]) + GATE["margin"] if scores.get(promoted) else -np.inf
    passing = [
        v
        for v, values in scores.items()
        if v > promoted
        and v not in evicted
        and len(values) >= GATE["min_eval_sessions"]
        and np.mean(np.asarray(values, dtype=np.float64)) >= bar
    ]
    return max(passing, default=promoted)


def evict(data_dir: Path, run_id: str, version: int) -> None:
    """Mark a version evicted in the store, as retention does."""
    with sqlite3.connect(data_dir / "proxrl.db") as db:
        db.execute(
            "UPDATE run_versions SET evicted_at = CURRENT_TIMESTAMP, evicted_reason = ? "
            "WHERE run_id = ? AND version = ?",
            ("versions_kept: test", run_id, version),
        )


def promoted_at(data_dir: Path, run_id: str) -> dict[int, bool]:
    with sqlite3.connect(data_dir / "proxrl.db") as db:
        rows = db.execute(
            "SELECT version, promoted_at FROM run_versions WHERE run_id = ?", (run_id,)
        ).fetchall()
    return {version: at is not None for version, at in rows}


def test_the_gate_promotes_exactly_when_the_rule_says_never_an_evicted_version(
    lora_app, tiny_model_dir, tmp_path
):
    api, data_dir = lora_app
    run = api.new_run()["id"]
    assert promoted(api, run) is None  # no gate
    shown = api.ok("PATCH", f"/rl/runs/{run}", json={"config": {"promotion": GATE}})
    assert shown["config"]["promotion"] == GATE
    assert shown["promotion"] == {
        "promoted_version": 0,
        "promoted_count": 0,
        "promoted_mean": None,
        "margin": 0.25,
        "min_eval_sessions": 2,
        "candidates": [],
    }
    scores: dict[int, list[float]] = {}
    evicted: set[int] = set()
    expected = 0

    def score(version: int, session: dict, value: float) -> None:
        nonlocal expected
        api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": value})
        scores.setdefault(version, []).append(value)
        expected = reference(expected, scores, evicted)
        assert promoted(api, run) == expected, (version, scores)

    def eval_session() -> dict:
        session = api.new_session(run, eval=True)
        api.chat(session)
        return session

    # Rewards on quarters: every mean is exact in float64, so ties are ties.
    plan = {0: [0.5, 0.5], 1: [0.75, 0.5, 1.0], 2: [1.0]}
    for version, rewards in plan.items():
        if version:
            path = make_adapter(tiny_model_dir, tmp_path / f"a{version}", version)
            api.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": path})
        for value in rewards:
            score(version, eval_session(), value)
    assert expected == 1  # version 1 met the bar exactly (0.75 = 0.5 + 0.25) at its third

    waiting = [eval_session(), eval_session()]  # answered by version 2, rewarded below
    path = make_adapter(tiny_model_dir, tmp_path / "a3", 3)
    api.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": path})
    evict(data_dir, run, 2)
    evicted.add(2)
    for session in waiting:
        score(2, session, 1.0)
    assert reference(1, scores, set()) == 2  # its mean 1.0 meets 0.75 + 0.25: but it is evicted
    gate = api.ok("GET", f"/rl/runs/{run}")["promotion"]
    assert [c["version"] for c in gate["candidates"]] == [3]  # the evicted one is no candidate
    assert (gate["promoted_count"], gate["promoted_mean"]) == (3, 0.75)
    for value in (1.0, 1.0):
        score(3, eval_session(), value)
    assert expected == 3 and promoted_at(data_dir, run) == {1: True, 2: False, 3: True}

    # By hand: any version the run can serve, older ones included; refusals in the REST shape.
    answer = api.ok("POST", f"/rl/runs/{run}/promote", json={"version": 1})
    assert answer["promotion"]["promoted_version"] == 1
    assert [c["version"] for c in answer["promotion"]["candidates"]] == [3]
    error = assert_error(api.call("POST", f"/rl/runs/{run}/promote", json={"version": 2}), 410)
    assert (error["code"], error["param"]) == ("version_evicted", "version")
    reply = api.call("POST", f"/rl/runs/{run}/promote", json={"version": 9})
    assert_error(reply, 404, code="version_not_found")
    for bad in (-1, "1", 1.5, None):
        assert_error(api.call("POST", f"/rl/runs/{run}/promote", json={"version": bad}), 422)
    reply = api.call("POST", "/rl/runs/run-nope/promote", json={"version": 0})
    assert_error(reply, 404, code="run_not_found")
    assert (
        api.ok("POST", f"/rl/runs/{run}/promote", json={"version": 0})["promotion"][
            "promoted_version"
        ]
        == 0
    )
    assert promoted(api, run) == 0

    removed = api.ok("PATCH", f"/rl/runs/{run}", json={"config": {"promotion": None}})
    assert removed["promotion"] is None and removed["config"]["promotion"] is None


def test_a_gate_in_the_run_config_at_creation_starts_at_the_base(lora_app):
    api, _ = lora_app
    run = api.new_run(promotion={"margin": 0.0, "min_eval_sessions": 1})
    assert run["promotion"]["promoted_version"] == 0
    assert run["config"]["promotion"] == {"margin": 0.0, "min_eval_sessions": 1}
    for bad in ({"margin": "x"}, {"min_eval_sessions": 0}, {"other": 1}, {"margin": 1e300}):
        reply = api.call("PATCH", f"/rl/runs/{run['id']}", json={"config": {"promotion": bad}})
        assert_error(reply, 422)
    reply = api.call("POST", "/rl/runs", json={"config": {"promotion": {"min_eval_sessions": -1}}})
    assert_error(reply, 422)


def test_full_weight_runs_cannot_be_gated_and_gated_runs_take_no_full_weights(own, tiny_model_dir):
    context, _ = own("promotion-full")
    with context as (api, _):
        gated = api.new_run(promotion=GATE)["id"]
        reply = api.call(
            "POST", "/admin/weights", json={"run_id": gated, "model_path": str(tiny_model_dir)}
        )
        error = assert_error(reply, 409, code="promotion_refused")
        assert error["param"] == "model_path" and "LoRA" in error["message"]
        assert api.ok("GET", f"/rl/runs/{gated}")["policy_version"] == 0

        full = api.new_run()["id"]
        body = {"run_id": full, "model_path": str(tiny_model_dir)}
        assert api.ok("POST", "/admin/weights", json=body)["policy_version"] == 1
        reply = api.call("PATCH", f"/rl/runs/{full}", json={"config": {"promotion": GATE}})
        error = assert_error(reply, 409, code="promotion_refused")
        assert error["param"] == "promotion"
        shown = api.ok("GET", f"/rl/runs/{full}")
        assert shown["config"]["promotion"] is None and shown["promotion"] is None
        reply = api.call("POST", f"/rl/runs/{full}/promote", json={"version": 0})
        assert_error(reply, 409, code="promotion_refused")
        assert api.ok("GET", f"/rl/runs/{full}")["promotion"] is None


def test_production_sessions_are_served_the_promoted_version_training_the_current(
    lora_app, tiny_model_dir, tmp_path
):
    """Each token a production session samples carries the promoted version, each token of a
    training (or eval) session the current one; without a gate, production is served the
    current version too."""
    api, _ = lora_app
    run = api.new_run()["id"]
    for version in (1, 2):
        path = make_adapter(tiny_model_dir, tmp_path / f"a{version}", 10 + version)
        api.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": path})

    def versions_of(**fields) -> set[int]:
        session = api.new_session(run, **fields)
        api.chat(session, max_tokens=6, temperature=0.0)
        (turn,) = api.session(session["session_id"])["turns"]
        return set(turn["versions"])

    assert versions_of(production=True) == {2}  # no gate: the current version
    api.ok("POST", f"/rl/runs/{run}/promote", json={"version": 1})
    deadline = time.monotonic() + 10  # the proxy's run cache may hold the old one a moment
    while (served := versions_of(production=True)) != {1}:
        assert time.monotonic() < deadline, served
        time.sleep(0.2)
    assert versions_of() == {2} and versions_of(eval=True) == {2}
    api.ok("POST", f"/rl/runs/{run}/promote", json={"version": 0})
    deadline = time.monotonic() + 10
    while (served := versions_of(production=True)) != {0}:
        assert time.monotonic() < deadline, served
        time.sleep(0.2)


def test_production_sessions_see_each_promotion_however_often_the_run_publishes(
    own, tiny_model_dir, tmp_path
):
    """A publish never makes the proxy forget or invent the promoted version: with nothing read
    yet (a gate from the run's creation), after a gate's promotion, a promotion by hand, a gate
    removed, each seen by the next production session. A promotion by another replica sharing
    the store is seen within the run cache's TTL even while this one publishes faster than it.
    An engine of its own: its many publishes would fill the shared one's adapter slots."""
    context, data_dir = own("promotion-publishes")
    paths = [make_adapter(tiny_model_dir, tmp_path / f"a{seed}", 20 + seed) for seed in (1, 2)]
    published = 0
    with context as (api, _):
        run = api.new_run(promotion={"margin": 0.0, "min_eval_sessions": 1})["id"]

        def publish() -> None:
            nonlocal published
            body = {"run_id": run, "adapter_path": paths[published % 2]}
            api.ok("POST", "/admin/weights", json=body)
            published += 1

        def production() -> set[int]:
            session = api.new_session(run, production=True)
            api.chat(session, max_tokens=4, temperature=0.0)
            (turn,) = api.session(session["session_id"])["turns"]
            return set(turn["versions"])

        publish()  # the proxy had not read the run yet
        assert production() == {0}  # the gate's base, not the version just published
        finished(api, run, 1.0, eval=True)  # answered by version 1: the gate promotes it
        assert promoted(api, run) == 1
        publish()
        assert production() == {1}
        api.ok("POST", f"/rl/runs/{run}/promote", json={"version": 0})
        publish()
        assert production() == {0}
        api.ok("PATCH", f"/rl/runs/{run}", json={"config": {"promotion": None}})
        publish()
        assert production() == {published}  # no gate: the current version

        with sqlite3.connect(data_dir / "proxrl.db") as db:  # another replica promotes 2
            db.execute("UPDATE runs SET promoted_version = 2 WHERE id = ?", (run,))
        start, seen = time.monotonic(), []
        while (served := production()) != {2}:
            seen.append(served)
            assert time.monotonic() - start < RUN_ADAPTER_TTL_S + 2, seen
            publish()
            time.sleep(0.1)
