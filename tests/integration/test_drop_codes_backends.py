"""Dropped sessions by reason code (``server.store.stats.dropped_by_reason``), grouped in SQL on
a real SQLite file and a real PostgreSQL database: the code is the text before the first colon,
trimmed, the whole text without one; one row per code comes back, however the details after the
colon differ; ``claimed`` counts only the sessions dropped under a trainer's claim."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, literal, select

from server.store import database, stats
from server.store.tables import Run, Session

NOW = datetime(2026, 11, 23, 8, 30, tzinfo=UTC)
REASONS = {  # drop_reason: (claim id, the code it counts under)
    "stale: tokens 3 updates behind": ("claim-a", "stale"),
    "stale: tokens 4 updates behind": ("claim-a", "stale"),
    "stale:9": ("claim-b", "stale"),
    "no_contrast": ("claim-a", "no_contrast"),
    " spaced : a: b: c": ("claim-b", "spaced"),
    "no_turns: the session ended without a model call": (None, "no_turns"),
    "incomplete_group: g had 1 of group_size 4": (None, "incomplete_group"),
}


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'drops.db'}"
    return request.getfixturevalue("postgres").new_database()


def seed(url: str) -> None:
    database.upgrade(url)
    engine = database.connect_sync(url)
    with engine.begin() as connection:
        for run_id in ("run-drops", "run-other"):
            connection.execute(
                insert(Run).values(
                    id=run_id, name="r", model="tiny", config={}, api_key_hash=f"h-{run_id}",
                    policy_version=0, is_default=False, created_at=NOW,
                )
            )  # fmt: skip
        rows = [
            (f"s{i}", "run-drops", reason, claim)
            for i, (reason, (claim, _)) in enumerate(REASONS.items())
        ]
        rows.append(("s-other", "run-other", "stale: elsewhere", "claim-c"))
        rows.append(("s-kept", "run-drops", None, "claim-a"))  # consumed, not dropped
        for session_id, run_id, reason, claim_id in rows:
            connection.execute(
                insert(Session).values(
                    id=session_id, run_id=run_id, meta={}, api_key_hash=f"h-{session_id}",
                    status="dropped" if reason else "consumed", drop_reason=reason,
                    claim_id=claim_id, created_at=NOW, last_activity_at=NOW, rewarded=True,
                    turn_count=1, row_count=1, breaks=0,
                )
            )  # fmt: skip
    engine.dispose()


async def read(url: str, claimed: bool) -> dict[str, dict[str, int]]:
    engine = database.connect(url)
    try:
        async with database.sessionmaker(engine)() as db:
            return await stats.dropped_by_reason(db, ["run-drops", "run-none"], claimed=claimed)
    finally:
        await engine.dispose()


async def codes_of(url: str, texts: list[str]) -> list[str]:
    engine = database.connect(url)
    try:
        async with database.sessionmaker(engine)() as db:
            dialect = db.get_bind().dialect.name
            return [await db.scalar(select(stats.reason_code(literal(t), dialect))) for t in texts]
    finally:
        await engine.dispose()


def test_drops_are_counted_by_code_in_sql_on_both_backends(db_url):
    seed(db_url)
    every = asyncio.run(read(db_url, claimed=False))
    assert every == {
        "run-drops": {
            "stale": 3,
            "no_contrast": 1,
            "spaced": 1,
            "no_turns": 1,
            "incomplete_group": 1,
        },
        "run-none": {},
    }
    by_trainer = asyncio.run(read(db_url, claimed=True))
    assert by_trainer == {"run-drops": {"stale": 3, "no_contrast": 1, "spaced": 1}, "run-none": {}}


def test_the_code_is_the_text_before_the_first_colon_trimmed(db_url):
    database.upgrade(db_url)
    texts = ["stale: x", "no_contrast", " a : b : c", ":leading", "a:", ""]
    assert asyncio.run(codes_of(db_url, texts)) == ["stale", "no_contrast", "a", "", "a", ""]
