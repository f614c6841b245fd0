"""A replica that lost the lead mid-swap must not resume the engines under the swap of the
replica that leads now (``server.rl.weights._resume``): its resume is sent, or not, with the
``leader`` row locked, which a replica taking the lead rewrites before it leads.

Replicas as in test_leader_replicas.py (its fixtures: the whole app in a thread per replica,
over one Postgres database, sharing one real embedded engine). The weights failpoint holds each
swap with the engine paused and nothing loaded; it is read when a swap reaches it, so each swap
here is held as long as the failpoint said then.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import psycopg
import pytest

from server.rl import weights
from server.rl.weights import FAILPOINT
from tests.integration.test_leader_replicas import (  # noqa: F401 (fixtures)
    ADMIN,
    _versions_of,
    engine,
    leaders,
    lock_holders,
    start_replicas,
    wait_for,
)

FIRST_HOLD_S = 5.0  # the deposed leader's swap, from its pause to its check of the lead
SECOND_HOLD_S = 8.0  # the new leader's swap, from its pause to its load
ROW_HELD_S = 6.0  # the leader row held elsewhere after a swap's answer


@pytest.mark.timeout(180)
def test_a_deposed_leader_does_not_resume_the_engine_under_the_new_leaders_swap(
    start_replicas,  # noqa: F811
    engine,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    """The first replica pauses the engine for a swap and loses the lead (its lock's
    connection cut); the second takes the lead (and resumes the engine, as a takeover does) and
    pauses it for a swap of its own. When the first's swap ends (503 lost_leadership), the
    engine must stay paused until the second's swap has loaded and recorded its version, and a
    request sent meanwhile to the first (a follower now, whose requests go straight to the
    engine) is served only after it, by the new version. On the code before, the first's resume
    un-paused the engine under the second's swap: the request was served at once, by the old
    weights."""
    monkeypatch.setenv(FAILPOINT, f"paused:{FIRST_HOLD_S:g}")
    url, (first, second) = start_replicas(2, health_interval_s=0.2)
    scheduler = engine.service.scheduler
    made = first.post("/rl/sessions", json={"task_id": "fence"})
    assert made.status_code == 201, made.text
    session = made.json()
    weights = {"model_path": str(tiny_model_dir)}
    seen = asyncio.run(
        _deposed_then_leading(url, first, second, scheduler, weights, session, monkeypatch)
    )
    deposed, leading = seen["deposed"], seen["leading"]
    assert deposed.status_code == 503, deposed.text
    assert deposed.json()["error"]["code"] == "lost_leadership", deposed.text
    assert leading.status_code == 200, leading.text
    assert leading.json()["policy_version"] == 1
    took = seen["request took"]
    print(f"a request sent to the deposed replica under the new leader's swap: {took:.2f} s")
    assert seen["paused after the deposed answered"] == "abort"  # the code before: None
    assert not seen["request served during the swap"]
    assert seen["request"].status_code == 200, seen["request"].text
    assert scheduler.paused is None  # the leader's own resume
    turns = first.get(f"/rl/sessions/{session['session_id']}").json()["turns"]
    assert set(turns[-1]["versions"]) == {1}, turns[-1]  # sampled by the new weights only
    assert _versions_of(first) == [1]
    assert [len(r.app.state.ctx.pool.swaps) for r in (first, second)] == [0, 1]


async def _deposed_then_leading(url, first, second, scheduler, weights, session, monkeypatch):
    """The first's swap paused, its lead cut, the second leading and swapping; what was seen."""
    seen: dict = {}
    async with httpx.AsyncClient(timeout=120, headers=ADMIN) as http:
        deposed = asyncio.create_task(http.post(f"{first.url}/admin/weights", json=weights))
        while scheduler.paused is None:  # the first's swap has paused the engine
            assert not deposed.done(), deposed.result().text
            await asyncio.sleep(0.01)
        (holder,) = lock_holders(url)
        with psycopg.connect(url, autocommit=True) as db:  # its lock's connection cut
            db.execute("SELECT pg_terminate_backend(%s)", (holder,))
        deadline = time.monotonic() + 4.0
        while leaders([first, second]) != [second] or scheduler.paused is not None:
            assert time.monotonic() < deadline, "the second did not take over (and resume)"
            await asyncio.sleep(0.02)
        assert not deposed.done(), "the first's swap ended before the second led"
        monkeypatch.setenv(FAILPOINT, f"paused:{SECOND_HOLD_S:g}")
        leading = asyncio.create_task(http.post(f"{second.url}/admin/weights", json=weights))
        while scheduler.paused is None:  # the second's swap has paused the engine
            assert not leading.done(), leading.result().text
            await asyncio.sleep(0.01)
        seen["deposed"] = await deposed
        assert not leading.done(), "the second's swap ended before the first's"
        seen["paused after the deposed answered"] = scheduler.paused
        request = asyncio.create_task(_ask(http, session))
        await asyncio.sleep(1.0)  # served by now, if the engine were not paused
        seen["request served during the swap"] = request.done()
        seen["leading"] = await leading
        seen["request"], seen["request took"] = await request
    return seen


async def _ask(http: httpx.AsyncClient, session: dict) -> tuple[httpx.Response, float]:
    """A chat request in the session: the answer, and the seconds it took."""
    asked = time.monotonic()
    reply = await http.post(
        f"{session['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "which weights?"}],
            "max_tokens": 4,
        },
    )
    return reply, time.monotonic() - asked


@pytest.mark.timeout(180)
def test_a_leader_whose_store_cannot_fence_the_resume_resumes_once_it_can(
    start_replicas,  # noqa: F811
    engine,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    """The ``leader`` row locked elsewhere (for ``ROW_HELD_S``, as a cut-off transaction holds it
    until Postgres ends it) while a swap holds the engine paused: the swap's checks of the lead
    and its resume's check of who leads wait out the lock timeout, so the swap answers 503
    lost_leadership with the engine still paused. While the row is held, nobody can say whether
    another replica paused the engine for a swap of its own, so it stays paused (the takeover's
    resume is fenced as the swap's is); once the row is free, the replica, which still holds the
    lead, resumes it at its next leader check, not leaving it paused for good."""
    monkeypatch.setenv(FAILPOINT, "paused:2")
    url, (only,) = start_replicas(1, health_interval_s=0.2)
    scheduler = engine.service.scheduler
    release, locked = threading.Event(), threading.Event()
    released_at: list[float] = []

    def hold_the_row() -> None:
        with psycopg.connect(url) as db:
            db.execute("SELECT * FROM leader FOR UPDATE")
            locked.set()
            release.wait(120)
            db.rollback()
            released_at.append(time.monotonic())

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120, headers=ADMIN) as http:
            swapping = asyncio.create_task(
                http.post(f"{only.url}/admin/weights", json={"model_path": str(tiny_model_dir)})
            )
            while scheduler.paused is None:
                assert not swapping.done(), swapping.result().text
                await asyncio.sleep(0.01)
            holder.start()
            assert await asyncio.to_thread(locked.wait, 30)
            return await swapping

    holder = threading.Thread(target=hold_the_row, daemon=True)
    try:
        reply = asyncio.run(run())
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "lost_leadership", reply.text
        time.sleep(ROW_HELD_S)
        assert scheduler.paused is not None  # fenced: not resumed while the row is held
    finally:
        release.set()
        holder.join(timeout=30)
    wait_for(lambda: scheduler.paused is None, 15.0, "the engine resumed")
    print(f"the engine resumed {time.monotonic() - released_at[0]:.2f} s after the row was free")
    wait_for(lambda: only.leading, 5.0, "the replica to lead")
    assert _versions_of(only) == [0]
    retry = only.post("/admin/weights", json={"model_path": str(tiny_model_dir), "version": 1})
    assert retry.status_code == 200, retry.text
    assert _versions_of(only) == [1] and scheduler.paused is None


@pytest.mark.timeout(180)
def test_a_takeover_waits_for_a_pause_sent_before_it(
    start_replicas,  # noqa: F811
    engine,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    """The leader's pause on its way to the engine (the engine takes 2 s to apply it) when its
    lock's connection is cut: the second replica must lead only after the pause was applied, so
    that the resume of its takeover comes after it (a pause landing after that resume would
    leave the engine paused with no swap to resume it, now that a deposed leader leaves the
    engines to the one that leads). At the end the engine serves, unpaused. On the code before,
    the pause was sent after the check of the lead, outside its transaction: the second led
    while the pause was still on its way."""
    monkeypatch.setenv(FAILPOINT, "paused:3")
    url, (first, second) = start_replicas(2, health_interval_s=0.2)
    service = engine.service
    real_run = service.run
    pausing = threading.Event()
    applied: list[float] = []

    async def slow_pause(fn):
        if "pause" not in getattr(getattr(fn, "__code__", None), "co_names", ()):
            return await real_run(fn)
        pausing.set()
        await asyncio.sleep(2.0)
        result = await real_run(fn)
        applied.append(time.monotonic())
        return result

    monkeypatch.setattr(service, "run", slow_pause)

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(timeout=120, headers=ADMIN) as http:
            swapping = asyncio.create_task(
                http.post(f"{first.url}/admin/weights", json={"model_path": str(tiny_model_dir)})
            )
            assert await asyncio.to_thread(pausing.wait, 30), "no pause reached the engine"
            (holder,) = lock_holders(url)
            with psycopg.connect(url, autocommit=True) as db:  # its lock's connection cut
                db.execute("SELECT pg_terminate_backend(%s)", (holder,))
            deadline = time.monotonic() + 10.0
            while not second.leading:
                assert time.monotonic() < deadline, "the second did not take the lead"
                await asyncio.sleep(0.01)
            led = time.monotonic()
            return await swapping, led

    reply, led = asyncio.run(run())
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "lost_leadership", reply.text
    (paused_at,) = applied
    print(f"the second led {led - paused_at:+.2f} s after the pause was applied")
    assert led >= paused_at  # the code before: about a second before it
    wait_for(lambda: engine.service.scheduler.paused is None, 5.0, "the engine resumed")
    monkeypatch.undo()
    retry = second.post("/admin/weights", json={"model_path": str(tiny_model_dir), "version": 1})
    assert retry.status_code == 200, retry.text
    assert _versions_of(second) == [1] and engine.service.scheduler.paused is None


@pytest.mark.timeout(180)
def test_an_engine_whose_pause_comes_after_the_swap_is_resumed_by_the_leader(
    start_replicas,  # noqa: F811
    engine,  # noqa: F811
    tiny_model_dir,
    monkeypatch,
):
    """A swap's pause the engine applies only after the swap gave up waiting for it (2 s, past
    a fenced call's bound, here 0.5 s) and after the swap's resume: the engine is paused with no
    swap to resume it. The leader resumes it again at its next check (``heal_pauses``) and it
    serves. On the code before, it stayed paused until the next swap: every request held."""
    monkeypatch.setattr(weights, "FENCED_CALL_S", 0.5)
    _, (leader,) = start_replicas(1, health_interval_s=0.2, leader_check_s=0.2)
    service = engine.service
    real_run = service.run
    applied = threading.Event()

    async def late_pause(fn):
        if "pause" not in getattr(getattr(fn, "__code__", None), "co_names", ()):
            return await real_run(fn)
        await asyncio.sleep(2.0)
        result = await real_run(fn)
        applied.set()
        return result

    monkeypatch.setattr(service, "run", late_pause)
    reply = leader.post("/admin/weights", json={"model_path": str(tiny_model_dir)})
    assert reply.status_code == 200, reply.text
    assert applied.wait(10), "the late pause never reached the engine"
    monkeypatch.setattr(service, "run", real_run)
    wait_for(lambda: service.scheduler.paused is None, 10.0, "the leader resumed the engine")
    (pool_engine,) = leader.app.state.ctx.pool.engines
    wait_for(lambda: pool_engine.late_pause is None, 5.0, "the late pause is known spent")
    made = leader.post("/rl/sessions", json={"task_id": "late-pause"})
    assert made.status_code == 201, made.text
