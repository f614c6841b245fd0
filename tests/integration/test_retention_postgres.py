"""Retention never evicts a version promoted while a publish records its own (real PostgreSQL).

A promotion by hand locks the run's row and marks version 1 promoted; a publish of version 4
with room for 2 versions runs meanwhile. It read the run's promoted version (none) before the
promotion committed, and evicted version 1 as the oldest: every production request was then a
410. Now the publish reads the run under its row lock, after the promotion's commit."""

from __future__ import annotations

import asyncio

from server.store import database, run_versions, runs

WAIT_S = 0.5  # long enough for the publish to reach the row lock the promotion holds


def test_a_version_promoted_while_a_publish_records_is_not_evicted(postgres):
    url = postgres.new_database()
    database.upgrade(url)

    async def scenario() -> tuple[int | None, dict[int, str | None]]:
        engine = database.connect(url)
        maker = database.sessionmaker(engine)
        try:
            async with maker() as db, db.begin():
                run, _ = await runs.create_run(db, "r", "m", {})
                run_id = run.id
            for version in (1, 2, 3):
                async with maker() as db, db.begin():
                    await runs.set_policy_version(db, run_id, version, f"/a{version}", lora=True)
            async with maker() as promoting, promoting.begin():
                locked = await runs.lock_run(promoting, run_id)
                assert locked is not None

                async def publish() -> None:
                    async with maker() as db, db.begin():
                        kept = run_versions.Retention(kept=2)
                        await runs.set_policy_version(
                            db, run_id, 4, "/a4", lora=True, retention=kept
                        )

                publishing = asyncio.create_task(publish())
                await asyncio.sleep(WAIT_S)
                locked.promoted_version = 1
                await run_versions.mark_promoted(promoting, run_id, 1)
            await publishing
            async with maker() as db:
                promoted = (await runs.get_run(db, run_id)).promoted_version  # type: ignore[union-attr]
                rows = await run_versions.listed(db, run_id)
            return promoted, {row.version: row.evicted_reason for row in rows}
        finally:
            await engine.dispose()

    promoted, evicted = asyncio.run(scenario())
    assert promoted == 1
    assert evicted[1] is None and evicted[4] is None, evicted  # promoted, current: kept
    assert evicted[2] is not None and evicted[3] is not None, evicted  # room for 2 in all
