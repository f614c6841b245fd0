"""A server stops between its loops' rounds, never inside one.

Its deadline sweeper and leader check query the store each round. Cancelled inside a query, a
round left its SQLite connection to SQLAlchemy's terminate path, whose close over aiosqlite
could wait forever: a test's teardown hung 300 s in CI, and the store health logged a lost
connection on the way out. Now a stopping server lets the round under way end, and cancels
only one that outlasts ``LOOP_STOP_WAIT_S``. Shown with the real app on a real SQLite file,
started and stopped with the sweeper running every millisecond (it hung within 10 of 150 stops
before), and on the loop helpers themselves."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server import startup
from tests.api.api_support import app_settings

STOPS = 40
STOP_BOUND_S = 10.0


def test_a_server_whose_sweeper_is_mid_round_stops_at_once_every_time(
    tiny_model_dir: Path, engine, tmp_path: Path, caplog
):
    from server.main import create_app

    caplog.set_level(logging.WARNING)
    chance = random.Random(7)
    slowest = 0.0
    for i in range(STOPS):
        settings = app_settings(
            tiny_model_dir, engine.url, tmp_path / f"d{i}", sweep_interval_s=0.001
        )
        client = TestClient(create_app(settings))
        client.__enter__()
        time.sleep(chance.random() * 0.2)
        started = time.monotonic()
        client.__exit__(None, None, None)
        slowest = max(slowest, time.monotonic() - started)
    assert slowest < STOP_BOUND_S, slowest
    assert not [r for r in caplog.records if "store unavailable" in r.getMessage()]


def test_a_round_under_way_ends_and_one_that_hangs_is_cancelled(monkeypatch):
    monkeypatch.setattr(startup, "LOOP_STOP_WAIT_S", 0.2)

    async def scenario() -> tuple[list[str], asyncio.Task, asyncio.Task]:
        stopping = asyncio.Event()
        events: list[str] = []
        in_round = asyncio.Event()

        async def finishing() -> None:
            while not await startup.paused(stopping, 0.0):
                in_round.set()
                await asyncio.sleep(0.05)  # a round under way when the stop comes
                events.append("round ended")

        async def hanging() -> None:
            while not await startup.paused(stopping, 0.0):
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    events.append("hung round cancelled")
                    raise

        tasks = asyncio.create_task(finishing()), asyncio.create_task(hanging())
        await in_round.wait()
        started = time.monotonic()
        await startup.stop_loops(stopping, [*tasks, None])
        events.append(f"stopped in {time.monotonic() - started:.1f}s")
        return events, *tasks

    events, finishing, hanging = asyncio.run(scenario())
    assert events[0] == "round ended" and "hung round cancelled" in events
    assert finishing.done() and not finishing.cancelled()
    assert hanging.cancelled()
    assert float(events[-1].split()[-1][:-1]) < 1.5


@pytest.mark.parametrize("seconds", [0.0, 0.05])
def test_paused_says_whether_the_server_is_stopping(seconds):
    async def scenario() -> tuple[bool, bool]:
        stopping = asyncio.Event()
        first = await startup.paused(stopping, seconds)
        stopping.set()
        return first, await startup.paused(stopping, 3600)

    assert asyncio.run(scenario()) == (False, True)
