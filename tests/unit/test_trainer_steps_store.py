"""server/store/steps.py on a real SQLite store: a repost replaces a step's figures, and its
time stays the time the step was trained unless the step was trained again (a new version).

The same rule on PostgreSQL, through the server: tests/integration/test_dashboard_api.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from server.store import database, stats, steps
from server.store.tables import Base, Run, TrainerStep

START = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def minutes(n: int) -> datetime:
    return START + timedelta(minutes=n)


async def recorded(
    path: Path, posts: list[tuple[int, int, int, dict]], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[bool], dict]:
    """Post ``(minute, step, version, metrics)`` in order, each at its minute; what each post
    returned, and the run's rows and step span at the end."""
    engine = database.connect(f"sqlite:///{path / 'steps.db'}")
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        maker = database.sessionmaker(engine)
        async with maker() as db, db.begin():
            db.add(Run(id="run", name="r", model="m", config={}, api_key_hash="run-key"))
        created = []
        for minute, step, version, metrics in posts:
            monkeypatch.setattr(steps, "utcnow", lambda minute=minute: minutes(minute))
            async with maker() as db, db.begin():
                created.append(await steps.record_step(db, "run", step, version, metrics))
        async with maker() as db:
            rows = list(await db.scalars(select(TrainerStep).order_by(TrainerStep.step)))
            span = (await stats.step_spans(db, ["run"]))["run"]
        return created, {"rows": rows, "span": span}
    finally:
        await engine.dispose()


def test_a_clean_stops_repost_keeps_the_last_steps_time(tmp_path, monkeypatch):
    """The trainer waited 10 minutes for sessions after step 2, then stopped cleanly: the step
    says stopped_at, but its time (the dashboard's "last step ... ago", the step interval) is
    still when it was trained."""
    posts = [
        (0, 1, 1, {"reward_mean": 0.5}),
        (1, 2, 2, {"reward_mean": 0.6}),
        (11, 2, 2, {"reward_mean": 0.6, "stopped_at": 1.0}),
    ]
    created, found = asyncio.run(recorded(tmp_path, posts, monkeypatch))
    assert created == [True, True, False]
    step_two = found["rows"][1]
    assert step_two.metrics == {"reward_mean": 0.6, "stopped_at": 1.0}
    assert step_two.created_at == minutes(1)
    assert (found["span"].count, found["span"].last_at) == (2, minutes(1))


def test_a_step_trained_again_takes_its_new_figures_and_time(tmp_path, monkeypatch):
    """A trainer killed after step 2 and resumed from step 1's checkpoint trains step 2 again
    at a new version: the new figures and the new time replace the old."""
    posts = [
        (0, 1, 1, {"reward_mean": 0.5}),
        (1, 2, 2, {"reward_mean": 0.6}),
        (30, 2, 4, {"reward_mean": 0.7}),
    ]
    created, found = asyncio.run(recorded(tmp_path, posts, monkeypatch))
    assert created == [True, True, False]
    step_two = found["rows"][1]
    assert (step_two.version, step_two.metrics) == (4, {"reward_mean": 0.7})
    assert step_two.created_at == minutes(30)
    assert (found["span"].count, found["span"].last_at) == (2, minutes(30))
