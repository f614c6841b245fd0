"""The staleness simulator (bench/staleness_sim.py): its books balance, it is deterministic, it
keeps the bound where the bound holds (places held never above (eta + 1) * batch_size under
``places``, restarts included), and the two parts it models rather than imports (the held-place
count and the single trainer's claim, both SQL) agree with the real store on random inputs."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import random
import re
import sys
import tempfile
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.rl.admission import Held
from server.store import claims, database
from server.store import sessions as store
from server.store.groups import GroupRule
from server.store.tables import Base, Run, Session, utcnow

NOW = utcnow()  # the store's own clock: its datetimes come back as it writes them

ROOT = Path(__file__).resolve().parents[2]


def _load_bench(name: str):
    """A bench script as a module (bench/ is no package, and on sys.path its trainer.py
    would shadow ours)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sim = _load_bench("staleness_sim")

SMALL = dict(batch_size=8, steps=30, step_s=10.0)


def cell(**changes) -> sim.Cell:
    return sim.Cell(**{**SMALL, **changes})


# --- the books ------------------------------------------------------------------------------


def test_events_are_processed_in_time_order():
    result = sim.simulate(
        cell(group_size=4, eta=1, restart_every=7, checkpoint_every=4), keep_events=True
    )
    assert len(result.events) > 100
    assert all(a <= b for a, b in zip(result.events, result.events[1:], strict=False))


@pytest.mark.parametrize(
    "changes",
    [
        dict(group_size=1, eta=0),
        dict(group_size=1, eta=2),
        dict(group_size=4, eta=1),
        dict(group_size=8, eta=4, group_timeout_s=30.0),
        dict(group_size=4, eta=1, restart_every=7, checkpoint_every=5),
        dict(group_size=4, eta=1, policy="current-drop"),
        dict(group_size=1, eta=1, policy="places"),
        dict(group_size=8, eta=2, policy="places", group_timeout_s=30.0),
        dict(group_size=4, eta=1, policy="places", restart_every=7, checkpoint_every=5),
    ],
)
def test_every_judged_token_is_trained_masked_or_dropped_exactly(changes):
    result = sim.simulate(cell(**changes))
    t = result.totals()
    assert t["sessions_judged"] > 0
    assert t["trained"] + t["masked"] + t["dropped_tokens"] == t["sampled"]
    assert sum(result.staleness.values()) == t["trained"]  # one staleness per trained token
    for judged in result.judged.values():
        assert judged.sampled == judged.trained + judged.masked + (
            judged.sampled if judged.dropped_reason else 0
        )
        assert (judged.dropped_reason is None) == (judged.trained > 0)


def test_trained_tokens_never_lag_more_than_eta():
    for eta in (0, 1, 3):
        result = sim.simulate(cell(group_size=4, eta=eta, restart_every=9, checkpoint_every=4))
        assert max(result.staleness, default=0) <= eta


def test_a_seed_gives_the_same_run_and_another_seed_another():
    a, b = sim.simulate(cell(group_size=4, eta=2)), sim.simulate(cell(group_size=4, eta=2))
    assert a.totals() == b.totals() and a.backlog == b.backlog
    assert sim.simulate(cell(group_size=4, eta=2, seed=1)).totals() != a.totals()


@pytest.mark.parametrize("policy", ["current", "places"])
def test_single_turn_sessions_lose_almost_nothing(policy):
    """AReaL's bound was made for single-turn rollouts: there it keeps every token fresh, and
    so does admission by places."""
    one_turn = sim.Workload(turns_median=1, turns_min=1, turns_max=1, tool_sigma=0)
    for group in (1, 4):
        for eta in (1, 4):
            run = cell(policy=policy, group_size=group, eta=eta, workload=one_turn)
            t = sim.simulate(run).totals()
            assert t["trained_share"] >= 0.99, (group, eta, t)
            assert t["sessions_dropped"] == 0


def test_sessions_are_admitted_up_to_the_bound_and_no_further():
    run = sim.Run(cell(group_size=1, eta=2))
    run.admit()
    assert run.admitted == len(run.sessions) == (2 + 0 + 1) * 8
    run.admit()
    assert len(run.sessions) == 24


def test_places_admit_whole_groups_up_to_the_bound():
    """Groups of 4, batch 8, eta 1: 16 places, four whole groups, nothing more."""
    run = sim.Run(cell(policy="places", group_size=4, eta=1))
    run.admit()
    assert len(run.sessions) == 16 and sim.places_held(run) == 16
    assert Counter(Counter(s.task_id for s in run.sessions.values()).values()) == {4: 4}
    run.admit()
    assert len(run.sessions) == 16


def recount(run: sim.Run) -> Held:
    """The run's held places counted afresh from every session (its books keep them as they
    change)."""
    members: dict[str, list[float]] = {}
    for s in run.sessions.values():
        if sim.holds_place(s.status, s.trained_version):
            members.setdefault(s.task_id, []).append(s.created_at)
    rows = [
        (None, task, len(created), sim.EPOCH + timedelta(seconds=max(created)))
        for task, created in members.items()
    ]
    now = sim.EPOCH + timedelta(seconds=run.now)
    return Held.of(rows, run.group_size, now, run.config.group_timeout_s)


@pytest.mark.parametrize(("group_size", "eta"), [(1, 0), (1, 3), (4, 1), (8, 2), (8, 0)])
def test_places_hold_the_bound_through_restarts_and_drop_nothing_for_staleness(group_size, eta):
    """Under ``places`` with a trainer crash every 7 steps: the places held never exceed
    (eta + 1) * batch_size (Run.check_bound raises at any admission that would), the books
    agree with a recount, no session is dropped for staleness and no token is masked."""
    run = sim.Run(
        cell(
            policy="places",
            group_size=group_size,
            eta=eta,
            steps=60,
            restart_every=7,
            checkpoint_every=5,
        )
    )
    result = run.run()
    t = result.totals()
    assert t["backlog_max"] <= (eta + 1) * 8 == t["bound"]
    assert run.held_sessions() == recount(run)
    assert "stale" not in t["drop_reasons"] and t["masked"] == 0
    assert len(run.republished) >= 5 and result.stalled_at is None  # it crashed, went on


@pytest.mark.parametrize(("group_size", "eta"), [(1, 0), (1, 2), (4, 1), (4, 4), (8, 2)])
def test_without_restarts_no_session_waits_more_than_eta_versions(group_size, eta):
    """Every session ahead of a group that just became claimable holds a place, so the
    group trains within eta versions of the one served then."""
    t = sim.simulate(cell(policy="places", group_size=group_size, eta=eta, steps=60)).totals()
    assert t["queue_lag_max"] <= eta and t["lag_over_eta_share"] == 0
    assert t["trained_share"] == 1.0 and t["sessions_dropped"] == 0


def test_groups_split_by_their_timeout_no_longer_stall_a_run():
    """Groups of 8 split by a 30 s group timeout: each remnant (a few members, claimed late)
    used to hold 8 places (Held.places), so three remnants filled (2 + 1) * 8 places with fewer
    than a batch of sessions, and the trainer, waiting for a whole batch, never got one. A
    group past its timeout now holds one place per member: the run goes on."""
    result = sim.simulate(cell(policy="places", group_size=8, eta=2, group_timeout_s=30.0))
    assert result.stalled_at is None
    assert result.totals()["stalled"] == 0 and result.totals()["steps"] == 30


def test_a_bounded_policy_that_overruns_its_bound_stops_the_cell(monkeypatch):
    """The bound is checked in the code path: a policy that admits everything while claiming
    to be bounded fails at its first admission past (eta + 1) * batch_size."""
    greedy = dataclasses.replace(sim.POLICIES["places"], room=lambda run, key: True)
    monkeypatch.setitem(sim.POLICIES, "greedy", greedy)
    capped = sim.Workload(max_open=40)
    with pytest.raises(AssertionError, match="above the"):
        sim.simulate(cell(policy="greedy", eta=1, workload=capped))


def drop_six(sessions, rules, baseline):
    """The trainer's judgement, but the batch's first six sessions dropped."""
    batch = sim.build_batch(sessions, rules, baseline)
    for data in sessions[:6]:
        batch.dropped[data["session_id"]] = "test: dropped"
    batch.samples = [s for s in batch.samples if s.session_id not in batch.dropped]
    return batch


def test_the_bound_leaks_what_the_trainer_drops(monkeypatch):
    """A step that drops 6 of its 8 sessions still publishes, and the drops leave the
    admission count at once: admitted-but-untrained goes 16 -> 22 -> 28 (batch 8, eta 1), as
    measured with the store's own functions."""

    leaky = dataclasses.replace(sim.POLICIES["current"], judge=drop_six)
    monkeypatch.setitem(sim.POLICIES, "drops-six", leaky)
    one_turn = sim.Workload(turns_median=1, turns_min=1, turns_max=1, tool_sigma=0)
    result = sim.simulate(cell(policy="drops-six", eta=1, steps=2, workload=one_turn))
    assert [b for _, _, b in result.backlog] == [22, 28]


def test_places_do_not_leak_what_the_trainer_drops(monkeypatch):
    """The same drops under places: a dropped session frees its place and nothing else
    does, so the places held stay at (eta + 1) * batch_size."""

    leaky = dataclasses.replace(sim.POLICIES["places"], judge=drop_six)
    monkeypatch.setitem(sim.POLICIES, "places-drops-six", leaky)
    one_turn = sim.Workload(turns_median=1, turns_min=1, turns_max=1, tool_sigma=0)
    result = sim.simulate(cell(policy="places-drops-six", eta=1, steps=6, workload=one_turn))
    assert max(b for _, _, b in result.backlog) <= 16 and result.backlog_peak == 16


# --- the modelled parts against the real store ------------------------------------------------


async def _store(tmp: str):
    engine = database.connect(f"sqlite:///{tmp}/sim.db")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    maker = database.sessionmaker(engine)
    async with maker() as db, db.begin():
        db.add(Run(id="run", name="sim", model="m", config={}, api_key_hash="run-key"))
    return engine, maker


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sessions=st.lists(
        st.tuples(
            st.sampled_from(store.STATUSES),
            st.booleans(),  # eval
            st.one_of(st.none(), st.integers(0, 5)),  # trained_version
            st.one_of(st.none(), st.sampled_from(["g1", "g2", "g3"])),  # group_id
            st.one_of(st.none(), st.sampled_from(["t1", "t2"])),  # task_id
            st.sampled_from([0.0, 30.0, 700.0]),  # age: either side of a 600 s group timeout
        ),
        max_size=30,
    ),
    group_size=st.sampled_from([1, 2, 4]),
)
def test_the_held_places_are_the_stores(sessions, group_size):
    """holds_place, counted as the sim counts it, against server/store/sessions.py
    held_places: the same places, groups and keyless sessions."""

    async def real() -> list[tuple[str | None, str | None, int, datetime]]:
        with tempfile.TemporaryDirectory() as tmp:
            engine, maker = await _store(tmp)
            try:
                async with maker() as db, db.begin():
                    for i, row in enumerate(sessions):
                        status, is_eval, trained, group_id, task_id, age = row
                        db.add(
                            Session(
                                id=f"s{i}",
                                run_id="run",
                                api_key_hash=f"k{i}",
                                status=status,
                                eval=is_eval,
                                trained_version=trained,
                                group_id=group_id,
                                task_id=task_id,
                                created_at=NOW - timedelta(seconds=age),
                            )
                        )
                async with maker() as db:
                    return await store.held_places(db, "run")
            finally:
                await engine.dispose()

    modelled: dict[tuple[str | None, str | None], list[float]] = {}
    for status, is_eval, trained, group_id, task_id, age in sessions:
        if not is_eval and sim.holds_place(status, trained):
            modelled.setdefault((group_id, task_id), []).append(age)
    rows = [
        (g, t, len(ages), NOW - timedelta(seconds=min(ages))) for (g, t), ages in modelled.items()
    ]
    ours = Held.of(rows, group_size, NOW, 600.0)
    theirs = Held.of(asyncio.run(real()), group_size, NOW, 600.0)
    assert ours == theirs
    assert ours.places(group_size) == theirs.places(group_size)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    group_size=st.sampled_from([1, 2, 4]),
    max_sessions=st.integers(1, 12),
    trainable=st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([5.0, 50.0, 500.0])), max_size=20
    ),
)
def test_one_trainers_claim_is_the_stores(group_size, max_sessions, trainable):
    """Run.claim_once against server/store/claims.py claim: the same sessions claimed, the
    same dropped with the same reasons (ages keep clear of the 100 s group timeout)."""
    rule = GroupRule(group_size, 100.0, "drop")
    now = utcnow()
    rows = [
        (f"s{i:03d}", f"task-{task}", now - timedelta(seconds=age))
        for i, (task, age) in enumerate(trainable)
    ]

    async def real() -> tuple[set[str], dict[str, str]]:
        with tempfile.TemporaryDirectory() as tmp:
            engine, maker = await _store(tmp)
            try:
                async with maker() as db, db.begin():
                    for sid, task, at in rows:
                        db.add(
                            Session(
                                id=sid,
                                run_id="run",
                                api_key_hash=sid,
                                status=store.TRAINABLE,
                                task_id=task,
                                turn_count=1,
                                trainable_at=at,
                            )
                        )
                async with maker() as db, db.begin():
                    got = await claims.claim(db, "run", max_sessions, 300.0, rule)
                async with maker() as db:
                    found = await db.execute(
                        Session.__table__.select().where(Session.status == store.DROPPED)
                    )
                    dropped = {r.id: r.drop_reason for r in found}
                return {s.session_id for s in got.sessions}, dropped
            finally:
                await engine.dispose()

    run = sim.Run(cell(group_size=group_size, group_timeout_s=100.0))
    run.rule = rule
    run.now = (now - sim.EPOCH).total_seconds()
    for sid, task, at in rows:
        session = sim.SimSession(sid, task, [(1.0, 0.0, 1)], 0.0, status=store.TRAINABLE)
        session.candidate = sim.Candidate(sid, None, task, at)
        run.sessions[sid] = session
        run.trainable[sid] = session
    chosen = set(run.claim_once(max_sessions))
    dropped = {sid: j.dropped_reason for sid, j in run.judged.items()}
    real_chosen, real_dropped = asyncio.run(real())
    assert chosen == real_chosen

    # the reason names how long the group waited: the two clocks differ by milliseconds
    def waited(reasons: dict[str, str]) -> dict[str, str]:
        return {sid: re.sub(r"after [0-9.]+ s", "after _ s", r) for sid, r in reasons.items()}

    assert waited(dropped) == waited(real_dropped)


def test_grid_cli_writes_nothing_with_no_write(tmp_path, capsys):
    assert (
        sim.main(
            [
                "--groups",
                "1",
                "--etas",
                "1",
                "--seeds",
                "1",
                "--steps",
                "5",
                "--batch-size",
                "4",
                "--results-dir",
                str(tmp_path),
                "--no-write",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| current | 1 | 1 |" in out and "| places | 1 | 1 |" in out and "[2/2]" in out
    assert "## Before / after: current → places" in out
    assert not list(tmp_path.iterdir())


def test_reasons_are_the_trainers_codes():
    t = sim.simulate(cell(group_size=4, eta=1)).totals()
    assert set(t["drop_reasons"]) <= {"no_trainable_tokens", "incomplete_group", "stale"}
    assert Counter(t["drop_reasons"]).total() == t["sessions_dropped"]
    random.seed(0)  # nothing in the simulator reads the global generator
    assert sim.simulate(cell(group_size=4, eta=1)).totals() == t
