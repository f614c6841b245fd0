"""Publish a version of a LoRA run: its adapter, loaded beside the other runs' on every engine.

A LoRA run trains an adapter on the served base model; each version it publishes is loaded on
every engine in rotation under its own name (``<run id>@<version>``: a name is never reloaded with
other weights), without pausing anything: requests of other runs go on, and a request of this
run that began on the version before finishes on that version's adapter, which the engines keep
(``--adapters-kept`` newest versions per run; the publish that passes an older one unloads it
from every engine that lists it, before it loads the new one, so runs x kept adapters fit an
engine's bound). The run's requests are served with the new version from the moment the store
records it (``server.store.run_adapters``), and each token records the version of the adapter
that sampled it (``server.proxy.generation``).

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
from server.rl.weights import confirm_lead, refuse_shared, refuse_superseded, retention
from server.store import runs
from server.store.run_adapters import ServedAdapter, adapter_name

log = logging.getLogger(__name__)


async def publish(ctx: ServerContext, body: WeightsIn, source: int | None = None) -> WeightsOut:
    """Load the adapter at ``body.adapter_path`` on every engine in rotation as a new version of
    the run, and record it; a retry of a publish that was done (same version, same directory)
    is answered as done without loading anything. ``source``: the earlier version whose
    adapter this is (a rollback, ``server.rl.rollback``), loaded again under the new name."""
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
        await refuse_superseded(ctx, run.id, version, path, source)
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
        # Room first: the run's versions the engines no longer keep once this one is in, then
        # this version's name, which a publish whose load landed but whose record did not may
        # have left there with other weights (a name must never serve other weights).
        await _unload_where_held(ctx, engines, run.id, version - ctx.settings.adapters_kept)
        await _unload_where_held(ctx, engines, run.id, version, only=version)
        limit = ctx.settings.weights_pause_limit_s
        results = await load_all(engines, ctx.adapter_loads, name, path, limit)
        size_bytes = await weight_files.size(path)
        await confirm_lead(
            ctx,
            f"the engines loaded adapter {name} but version {version} was not recorded",
            lead,
            record=lambda db: runs.set_policy_version(
                db,
                run.id,
                version,
                path,
                lora=True,
                source=source,
                size_bytes=size_bytes,
                retention=retention(ctx),
            ),
        )
        ctx.run_adapters.put(ServedAdapter(run.id, version, path))
    seconds = time.perf_counter() - started
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


# How long a publish waits for one engine to list or unload adapters before it loads the new
# one (an unload waits for the requests running on that adapter): past it, the load goes on.
UNLOAD_WAIT_S = 30.0


def adapters_listed(cards: object, run_id: str) -> dict[str, int]:
    """The run's adapters an engine's ``/v1/models`` listing shows (cards with a parent model,
    named ``<run id>@<version>``), by name: their versions."""
    held = {}
    for card in cards if isinstance(cards, list) else []:
        name = str(card.get("id")) if isinstance(card, dict) and card.get("parent") else ""
        run, _, version = name.rpartition("@")
        if run == run_id and version.isdigit():
            held[name] = int(version)
    return held


async def _unload_where_held(
    ctx: ServerContext,
    engines: list[EngineState],
    run_id: str,
    newest: int,
    only: int | None = None,
) -> None:
    """Unload from each engine the run's adapters it lists (what it holds, not what this proxy
    remembers loading, which a restart or another replica's requests leave incomplete) of
    versions up to ``newest`` (``only`` that one), but for the pinned ones requests loaded there
    (``AdapterLoads``: bounded on their own). What an engine fails to list or unload within
    ``UNLOAD_WAIT_S`` stays: it costs memory there, not correctness."""

    async def on(engine: EngineState) -> None:
        try:
            async with asyncio.timeout(UNLOAD_WAIT_S):
                listed = adapters_listed((await engine.client.models()).get("data"), run_id)
                pinned = set(ctx.adapter_loads.pinned(engine.url)) if only is None else set()
                for name, number in listed.items():
                    if number > newest or (only is not None and number != only) or name in pinned:
                        continue
                    await ctx.adapter_loads.unload(engine.client, name, UNLOAD_WAIT_S)
        except (EngineError, TimeoutError) as exc:
            log.warning("could not unload run %s's adapters from %s: %s", run_id, engine.url, exc)

    await asyncio.gather(*map(on, engines))
