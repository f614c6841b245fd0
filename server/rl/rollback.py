"""Roll a run back: make an earlier version's weights current again, as a new version.

History is never rewritten. Rolling back to version c publishes version r = current + 1 that
serves c's weights (its ``run_versions`` row: parent the version current until then, source c),
exactly as a trainer's restart republishes a checkpoint (``trainer.staleness``: a republish
(c, r) is how the staleness rule counts a version that holds an earlier one's weights, so a
rollback needs no rule of its own). The engines load c's files under the new version: a LoRA
run's adapter directory as ``<run>@<r>`` (names are never reused), without a pause; a
full-weight run's weights directory, paused as any full-weight publish. Version 0 is the base:
for a LoRA run, no adapter; for a full-weight run, the served model (``--model``).

Refused: a version the run never published (404), one retention evicted or whose files are gone
(410), the current version or a later one (409), no engine in rotation (503). A rollback and a
publish never interleave (both hold the pool's update lock), and only the leader rolls back;
a trainer's publish that arrives after it under a number the rollback took is refused
(``weights.refuse_superseded``), and the trainer follows the rollback (``trainer.loop``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from server.context import ServerContext
from server.errors import (
    NoEngineToUpdate,
    RollbackRefused,
    RunNotFound,
    VersionEvicted,
    VersionNotFound,
)
from server.rl import adapters, weight_files, weights
from server.rl.schemas import RunVersionOut, WeightsIn, WeightsOut
from server.store import run_versions, runs
from server.store.tables import Run

log = logging.getLogger(__name__)


async def rollback(ctx: ServerContext, run_id: str, version: int) -> WeightsOut:
    """Publish the weights of the run's earlier ``version`` as its next version."""
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
        row = await run_versions.get(db, run_id, version) if run is not None else None
    if run is None:
        raise RunNotFound(run_id)
    current = run.policy_version
    if version >= current:
        raise RollbackRefused(
            f"Run {run_id} is at version {current}: a rollback makes an earlier version current "
            f"again, and {version} is {'the current one' if version == current else 'later'}."
        )
    if version > 0 and row is None:
        raise VersionNotFound(run_id, version)
    if row is not None and row.evicted_at is not None:
        raise VersionEvicted(
            f"Version {version} of run {run_id} was evicted ({row.evicted_reason}): its weights "
            "cannot be served again."
        )
    new = current + 1
    log.info("run %s: rolling back to version %d as version %d", run_id, version, new)
    path = None if row is None else row.path  # None: version 0, or a LoRA run's base again
    if run.lora and path is None:
        return await _serve_base(ctx, run_id, new, version)
    if path is None and version > 0:  # sent over a weight group: never written to disk
        raise VersionEvicted(
            f"Version {version} of run {run_id} was broadcast to the engines, never written to "
            "files: its weights cannot be served again."
        )
    if path is None:
        body = WeightsIn(model_path=ctx.settings.model, version=new, run_id=run_id)
        return await weights.publish(ctx, body, source=version)
    await _refuse_gone(ctx, run_id, version, path, run.lora)
    if run.lora:
        body = WeightsIn(adapter_path=path, version=new, run_id=run_id)
        return await adapters.publish(ctx, body, source=version)
    body = WeightsIn(model_path=path, version=new, run_id=run_id)
    return await weights.publish(ctx, body, source=version)


async def lineage(ctx: ServerContext, run: Run) -> list[RunVersionOut]:
    """The run's versions, oldest first, each with its parent and source (the lineage) and
    whether it is the current or the promoted one."""
    async with ctx.sessionmaker() as db:
        rows = await run_versions.listed(db, run.id)
    return [
        RunVersionOut(
            version=row.version,
            path=row.path,
            lora=row.lora,
            parent=row.parent,
            source=row.source,
            size_bytes=row.size_bytes,
            published_at=row.published_at,
            evicted_at=row.evicted_at,
            evicted_reason=row.evicted_reason,
            promoted_at=row.promoted_at,
            current=row.version == run.policy_version,
            promoted=row.version == run.promoted_version,
        )
        for row in rows
    ]


async def _refuse_gone(
    ctx: ServerContext, run_id: str, version: int, path: str, lora: bool
) -> None:
    """410 where the version's files are gone (the trainer's ``publish.keep_versions`` pruned
    them) or unreadable; the version is marked evicted, so a pin to it is refused at once."""
    seconds = ctx.settings.weights_check_timeout_s
    exists = await asyncio.to_thread(Path(path).exists)
    check = weight_files.adapter_problem if lora else weight_files.problem
    problem = None if not exists else await check(path, seconds)
    if exists and problem is None:
        return
    why = f"its files at {path!r} are gone" if not exists else f"its files: {problem}"
    async with ctx.sessionmaker() as db, db.begin():
        await run_versions.evict(db, run_id, [version], run_versions.FILES_GONE)
    raise VersionEvicted(f"Version {version} of run {run_id} cannot be served again: {why}.")


async def _serve_base(ctx: ServerContext, run_id: str, new: int, source: int) -> WeightsOut:
    """A LoRA run back at the base model: nothing to load, the run's requests served without an
    adapter from the record on."""
    pool = ctx.pool
    async with pool.update_lock:
        await weights.refuse_superseded(ctx, run_id, new, None, source)
        engines = pool.loadable
        if not engines:
            raise NoEngineToUpdate("No engine is in rotation to serve the base model.")
        await weights.confirm_lead(
            ctx,
            f"version {new} was not recorded",
            record=lambda db: runs.set_policy_version(
                db, run_id, new, None, lora=True, source=source
            ),
        )
        ctx.run_adapters.put_base(run_id)
    await ctx.admission.notify()
    served = [{"url": e.url, "success": True, "message": "serves the base model"} for e in engines]
    return WeightsOut(run_id=run_id, policy_version=new, engines=served, pause_seconds=0.0)
