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
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from server.context import ServerContext
from server.engine_client.client import EngineError, EngineRejected
from server.engine_client.pool import EngineState
from server.errors import (
    NoEngineToUpdate,
    RendezvousUnreachable,
    RunNotFound,
    WeightGroupRefused,
    WeightsRefused,
    WeightUpdateFailed,
)
from server.rl.schemas import (
    RENDEZVOUS_WAIT_S,
    DistributedWeightsIn,
    WeightGroupIn,
    WeightsIn,
    WeightsOut,
)
from server.store import runs

log = logging.getLogger(__name__)


Loader = Callable[[EngineState], Awaitable[dict[str, Any]]]


def from_disk(model_path: str, version: int) -> Loader:
    return lambda engine: engine.client.update_weights_from_disk(model_path, str(version))


def from_broadcast(body: DistributedWeightsIn, version: int) -> Loader:
    payload = body.model_dump(exclude_none=True)
    return lambda engine: engine.client.update_weights_from_distributed(payload, str(version))


async def _load(engine: EngineState, loader: Loader) -> dict:
    try:
        result = await loader(engine)
    except EngineRejected as exc:  # the engine read the request and refused it
        return {"url": engine.url, "success": False, "message": str(exc), "refused": True}
    except EngineError as exc:
        return {"url": engine.url, "success": False, "message": str(exc)}
    return {"url": engine.url, "success": bool(result.get("success")), **result}


async def publish(ctx: ServerContext, body: WeightsIn) -> WeightsOut:
    """Swap the weights ``body`` names into every engine in rotation, as a new version."""
    run_id, version = body.run_id, body.version
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id or ctx.default_run_id)
    if run is None:
        raise RunNotFound(run_id)
    version = run.policy_version + 1 if version is None else version
    pool = ctx.pool
    async with pool.update_lock:
        engines = pool.healthy
        if not engines:
            raise NoEngineToUpdate("No engine is in rotation to load the weights.")
        started = time.perf_counter()
        paused = await asyncio.gather(
            *(e.client.pause("abort") for e in engines), return_exceptions=True
        )
        if body.distributed is not None:
            loader = from_broadcast(body.distributed, version)
            source = f"the broadcast on {body.distributed.group_name!r}"
        else:
            loader = from_disk(str(body.model_path), version)
            source = str(body.model_path)
        try:
            results = await asyncio.gather(*(_load(e, loader) for e in engines))
        finally:
            await asyncio.gather(*(e.client.resume() for e in engines), return_exceptions=True)
        pause_seconds = time.perf_counter() - started
        if not any(r["success"] for r in results):  # nothing changed: no engine is to blame
            message = f"No engine loaded {source}: {results[0].get('message')}"
            if all(r.get("refused") for r in results):
                raise WeightsRefused(message, "model_path" if body.model_path else "distributed")
            raise WeightUpdateFailed(message)
        pool.expected_version = version
        for engine, pause_error, result in zip(engines, paused, results, strict=True):
            if isinstance(pause_error, Exception) or not result["success"]:
                pool.mark_down(engine, f"weight update failed: {result.get('message')}")
            else:
                engine.weight_version = str(version)
    swap = {"run_id": run.id, "version": version, "pause_seconds": pause_seconds, "at": time.time()}
    pool.swaps.append(swap)
    ctx.metrics.weight_swap_pause_seconds.observe(pause_seconds)
    async with ctx.sessionmaker() as db, db.begin():
        await runs.set_policy_version(db, run.id, version, body.model_path)
    await ctx.admission.notify()
    log.info("published version %d from %s (paused %.3fs)", version, source, pause_seconds)
    return WeightsOut(
        run_id=run.id, policy_version=version, engines=results, pause_seconds=pause_seconds
    )


def group_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the trainer's weight group, and the group's size. The trainer
    is rank 0; an engine of tensor-parallel size t holds the t ranks from its offset on
    (docs/architecture/sglang-protocol.md, "Ranks under tensor parallelism")."""
    offsets, next_rank = [], 1
    for tp_size in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp_size
    return offsets, next_rank


async def rendezvous_problem(host: str, port: int, wait_s: float) -> str | None:
    """None once something accepts a TCP connection at ``host:port`` (rank 0's store, which the
    trainer starts as it asks the engines to join), else why nothing did within ``wait_s``.

    Engines asked to join an address where nobody listens would block in their rendezvous for
    many minutes, so the caller's address is checked here first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            connecting = asyncio.open_connection(host, port)
            _, writer = await asyncio.wait_for(connecting, max(deadline - loop.time(), 0.1))
        except socket.gaierror as exc:
            return f"the host {host!r} does not resolve ({exc.strerror})"
        except (OSError, TimeoutError, ValueError) as exc:
            if loop.time() + 0.2 >= deadline:
                return f"nothing accepted a connection at {host}:{port} within {wait_s:g} s ({exc})"
            await asyncio.sleep(0.2)
            continue
        writer.close()
        return None


async def form_group(ctx: ServerContext, body: WeightGroupIn) -> dict[str, Any]:
    """Every engine in rotation joins the trainer's weight group (the trainer is rank 0).

    Answers 422 when the rendezvous is unreachable or an engine refuses the caller's values
    (naming the engine and its reason), 502 when an engine fails on its own."""
    engines = ctx.pool.healthy
    if not engines:
        raise NoEngineToUpdate("No engine is in rotation to join a weight group.")
    problem = await rendezvous_problem(body.master_address, body.master_port, RENDEZVOUS_WAIT_S)
    if problem is not None:
        raise RendezvousUnreachable(
            f"No engine was asked to join {body.group_name!r}: {problem}. Start rank 0's "
            "rendezvous (the trainer) at master_address:master_port first.",
            param="master_address",
        )
    offsets, world_size = group_ranks([engine.tp_size for engine in engines])

    async def join(rank: int, engine: EngineState) -> dict[str, Any]:
        request = {**body.model_dump(), "rank_offset": rank, "world_size": world_size}
        where = {"url": engine.url, "rank_offset": rank, "tp_size": engine.tp_size}
        try:
            return {**where, **await engine.client.init_weights_update_group(request)}
        except EngineRejected as exc:  # it read the caller's values and refused them
            return {**where, "success": False, "message": str(exc), "refused": True}
        except EngineError as exc:
            return {**where, "success": False, "message": str(exc)}

    results = await asyncio.gather(*(join(r, e) for r, e in zip(offsets, engines, strict=True)))
    failed = [r for r in results if not r.get("success")]
    if any(r.get("refused") for r in failed):
        refusals = "; ".join(f"{r['url']}: {r['message']}" for r in failed if r.get("refused"))
        raise WeightGroupRefused(f"An engine refused to join {body.group_name!r}: {refusals}")
    if failed:
        raise WeightUpdateFailed(f"Not every engine joined {body.group_name!r}: {failed}")
    return {"group_name": body.group_name, "world_size": world_size, "engines": results}
