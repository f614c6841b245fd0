"""Publish new weights: pause every engine, load the weights, continue, bump the version.

Pausing in ``abort`` mode returns every in-flight request with its partial tokens; the proxy
resubmits them at once (see ``generation``), and the paused engine holds them until it has
loaded the new weights, so clients see one uninterrupted answer. An engine that fails to load
while others succeed leaves the rotation, and the pool keeps it out until it serves the new
version, so no request is served by stale weights under the new version.
"""

from __future__ import annotations

import asyncio
import logging
import time

from server.context import ServerContext
from server.engines.client import EngineError, EngineRejected
from server.engines.pool import EngineState
from server.errors import BadGateway, BadRequest, NotFound, Unavailable
from server.schemas import WeightsOut
from server.store import runs

log = logging.getLogger(__name__)


async def _load(engine: EngineState, model_path: str, version: int) -> dict:
    try:
        result = await engine.client.update_weights_from_disk(model_path, str(version))
    except EngineRejected as exc:  # the engine read the request and refused it
        return {"url": engine.url, "success": False, "message": str(exc), "refused": True}
    except EngineError as exc:
        return {"url": engine.url, "success": False, "message": str(exc)}
    return {"url": engine.url, "success": bool(result.get("success")), **result}


async def publish(
    ctx: ServerContext, run_id: str | None, model_path: str, version: int | None
) -> WeightsOut:
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id or ctx.default_run_id)
    if run is None:
        raise NotFound(f"No run {run_id!r}.", code="run_not_found")
    version = run.policy_version + 1 if version is None else version
    pool = ctx.pool
    async with pool.update_lock:
        engines = pool.healthy
        if not engines:
            raise Unavailable("No engine is in rotation to load the weights.")
        started = time.perf_counter()
        paused = await asyncio.gather(
            *(e.client.pause("abort") for e in engines), return_exceptions=True
        )
        try:
            results = await asyncio.gather(*(_load(e, model_path, version) for e in engines))
        finally:
            await asyncio.gather(*(e.client.resume() for e in engines), return_exceptions=True)
        pause_seconds = time.perf_counter() - started
        if not any(r["success"] for r in results):  # nothing changed: no engine is to blame
            message = f"No engine loaded {model_path}: {results[0].get('message')}"
            if all(r.get("refused") for r in results):
                raise BadRequest(message, param="model_path")
            raise BadGateway(message)
        pool.expected_version = version
        for engine, pause_error, result in zip(engines, paused, results, strict=True):
            if isinstance(pause_error, Exception) or not result["success"]:
                pool.mark_down(engine, f"weight update failed: {result.get('message')}")
            else:
                engine.weight_version = str(version)
    pool.swaps.append({"version": version, "pause_seconds": pause_seconds, "at": time.time()})
    async with ctx.sessionmaker() as db, db.begin():
        await runs.set_policy_version(db, run.id, version, model_path)
    await ctx.admission.notify()
    log.info("published version %d from %s (paused %.3fs)", version, model_path, pause_seconds)
    return WeightsOut(
        run_id=run.id, policy_version=version, engines=results, pause_seconds=pause_seconds
    )
