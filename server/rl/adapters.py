"""Publish a version of a LoRA run: its adapter, loaded beside the other runs' on every engine.

A LoRA run trains an adapter on the served base model; each version it publishes is loaded on
every engine in rotation under its own name (``<run id>@<version>``: a name is never reloaded with
other weights), without pausing anything: requests of other runs go on, and a request of this
run that began on the version before finishes on that version's adapter, which the engines keep
(``--adapters-kept`` newest versions per run; older ones are unloaded by the publish that passes
them). The run's requests are served with the new version from the moment the store records it
(``server.store.run_adapters``), and each token records the version of the adapter that sampled
it (``server.proxy.generation``).

As for full weights, only the replica that leads publishes, and the version is recorded in a
transaction that finds it still leading. An engine that failed to load the adapter while others
did stays in rotation (it serves the other runs); a request of this run that reaches an engine
without the adapter loads it there first (``AdapterLoads``), or goes to another engine. Full
weights and adapters never share engines (``weights.refuse_shared``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from server.context import ServerContext
from server.engine_client.adapters import AdapterLoads
from server.engine_client.pool import EngineState
from server.errors import (
    EngineError,
    EngineRejected,
    NoEngineToUpdate,
    RunNotFound,
    WeightsRefused,
    WeightUpdateFailed,
)
from server.rl import weight_files
from server.rl.schemas import WeightsIn, WeightsOut
from server.rl.weights import confirm_lead, refuse_shared
from server.store import runs
from server.store.run_adapters import ServedAdapter, adapter_name

log = logging.getLogger(__name__)


async def publish(ctx: ServerContext, body: WeightsIn) -> WeightsOut:
    """Load the adapter at ``body.adapter_path`` on every engine in rotation as a new version of
    the run, and record it; a retry of a publish that was done (same version, same directory)
    is answered as done without loading anything."""
    assert body.adapter_path is not None
    path = str(body.adapter_path)
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, body.run_id or ctx.default_run_id)
    if run is None:
        raise RunNotFound(body.run_id)
    version = run.policy_version + 1 if body.version is None else body.version
    problem = await weight_files.adapter_problem(path, ctx.settings.weights_check_timeout_s)
    if problem is not None:
        message = f"The adapter at {path!r} cannot be loaded: {problem}. Nothing was loaded."
        raise WeightsRefused(message, "adapter_path", "weights_unreadable")
    pool = ctx.pool
    async with pool.update_lock:
        await refuse_shared(ctx, run.id, lora=True)
        engines = pool.loadable
        if not engines:
            raise NoEngineToUpdate("No engine is in rotation to load the adapter.")
        name = adapter_name(run.id, version)
        if run.lora and run.policy_version == version and run.weights_path == path:
            log.info("adapter %s is already the run's version: nothing loaded", name)
            done = [{"url": e.url, "success": True, "message": "already loaded"} for e in engines]
            return WeightsOut(run_id=run.id, policy_version=version, engines=done, pause_seconds=0)
        lead = await confirm_lead(ctx, "nothing was loaded")
        started = time.perf_counter()
        limit = ctx.settings.weights_pause_limit_s
        results = await load_all(engines, ctx.adapter_loads, name, path, limit)
        await confirm_lead(
            ctx,
            f"the engines loaded adapter {name} but version {version} was not recorded",
            lead,
            record=lambda db: runs.set_policy_version(db, run.id, version, path, lora=True),
        )
        ctx.run_adapters.put(ServedAdapter(run.id, version, path))
    seconds = time.perf_counter() - started
    _retire(ctx, run.id, version - ctx.settings.adapters_kept)
    ctx.metrics.weight_swap_pause_seconds.observe(0.0)  # nothing paused
    await ctx.admission.notify()
    log.info("published adapter %s in %.3fs (no pause)", name, seconds)
    return WeightsOut(run_id=run.id, policy_version=version, engines=results, pause_seconds=0.0)


async def load_all(
    engines: list[EngineState], loads: AdapterLoads, name: str, path: str, limit: float
) -> list[dict]:
    """Every engine's answer to loading the adapter (one that holds it already, as the name is
    never reused, counts as loaded), within ``--weights-pause-limit-s``: no engine pauses for
    it, but a hung one must not hold the publish lock. An engine that failed stays in rotation
    for the other runs; a request of this run loads it there first, or goes elsewhere."""

    async def load(engine: EngineState) -> dict:
        try:
            await loads.ensure(engine.client, name, path)
        except EngineRejected as exc:
            return {"url": engine.url, "success": False, "message": str(exc), "refused": True}
        except EngineError as exc:
            return {"url": engine.url, "success": False, "message": str(exc)}
        return {"url": engine.url, "success": True, "message": f"loaded as {name}"}

    try:
        results = await asyncio.wait_for(asyncio.gather(*map(load, engines)), limit)
    except TimeoutError:
        raise WeightUpdateFailed(
            f"The engines did not load adapter {name} within {limit:g} s "
            "(--weights-pause-limit-s): nothing was recorded.",
            code="weights_load_timeout",
        ) from None
    if not any(result["success"] for result in results):
        message = f"No engine loaded the adapter at {path!r}: {results[0]['message']}"
        if all(result.get("refused") for result in results):
            raise WeightsRefused(message + ". Nothing was recorded.", "adapter_path")
        raise WeightUpdateFailed(message)
    return list(results)


_retiring: set[asyncio.Task[None]] = set()  # unloads under way (each waits for its requests)


def _retire(ctx: ServerContext, run_id: str, newest_dropped: int) -> None:
    """Unload, in the background, the run's adapters of versions up to ``newest_dropped`` that
    this proxy knows an engine holds (an unload waits for the requests running on it, so the
    publish does not wait for it)."""
    prefix = f"{run_id}@"
    names = {
        name
        for engine in ctx.pool.engines
        for name in ctx.adapter_loads.names(engine.url)
        if name.startswith(prefix)
        and name[len(prefix) :].isdigit()
        and int(name[len(prefix) :]) <= newest_dropped
    }
    for name in sorted(names):
        task = asyncio.create_task(_unload(ctx, name))
        _retiring.add(task)
        task.add_done_callback(_retiring.discard)


async def _unload(ctx: ServerContext, name: str) -> None:
    """Unload ``name`` everywhere; an engine that holds it no more (refused) forgets it too, and
    one that failed (it is marked down) keeps it: it costs memory there, not correctness."""
    try:
        results = await ctx.pool.unload_adapter(name)
    except Exception:
        log.exception("could not unload adapter %s", name)
        return
    for result in results:
        if result["success"] or result.get("refused"):
            ctx.adapter_loads.unloaded(result["url"], name)
