"""Publish new weights: pause every engine, load the weights, record the new version, continue.

Nothing a publish waits on may stall serving: weight files are read and checked before any
engine pauses (``weight_files``), and the engines stay paused at most ``--weights-pause-limit-s``:
a load not done by then is abandoned and the engines resume the version they served. (An
engine whose load still finishes later serves its tokens under that new version's tag, and the
pool keeps it out while it serves a version other than the run's; the next publish loads it
with the engines in rotation, so a fleet whose every load finished late is not left with
none.) A weight group is joined only where a rendezvous store answers: something that merely
accepts connections is refused within seconds, before any engine waits on it.

Pausing in ``abort`` mode returns every in-flight request with its partial tokens; the proxy
resubmits them at once (see ``generation``), and the paused engine holds them until it has
loaded the new weights, so clients see one uninterrupted answer. An engine that fails to load
while others succeed leaves the rotation, and the pool keeps it out until it serves the new
version, so no request is served by stale weights under the new version.

Of replicas sharing a store, only the leader (``server.store.leadership``) swaps: a follower
forwards the caller's request to it (``forward``) and answers with the leader's answer as is.
The leader checks that it still leads before it pauses the engines and before it loads them,
and records the version only in a transaction that finds it still leading, under the same lead
(``leadership.lead_token``: a lead lost and taken back is another); a replica that lost the
lead on the way, or whose store did not confirm it within ``STORE_WAIT_S``, answers 503
``lost_leadership`` with nothing recorded. The version is recorded before the engines resume,
so a follower never finds them serving a version the store does not have yet.

The pause and the resume are each sent in a transaction that holds the ``leader`` row locked
(``leadership.locked_leader``), which a replica taking the lead rewrites first: a takeover, and
so a new leader's own swap, comes after the pause and after the resume, never between a check
and its call. A replica that finds another leading when its swap ends does not resume the
engines (the new leader resumed them as it took the lead and may hold them paused for its own
swap); one whose store does not say who leads leaves them to its next election round.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel

from server.context import ServerContext
from server.engine_client.client import EngineError, EngineRejected
from server.engine_client.pool import EnginePool, EngineState
from server.errors import (
    EnginesShared,
    NoEngineToUpdate,
    NoLeader,
    RendezvousUnreachable,
    RunNotFound,
    VersionSuperseded,
    WeightGroupRefused,
    WeightsConflict,
    WeightsRefused,
    WeightUpdateFailed,
)
from server.rl import promotion, weight_files
from server.rl.schemas import (
    RENDEZVOUS_WAIT_S,
    DistributedWeightsIn,
    WeightGroupIn,
    WeightsIn,
    WeightsOut,
)
from server.store import database, leadership, run_versions, runs
from server.store.database import Db, first_line

log = logging.getLogger(__name__)


Loader = Callable[[EngineState], Awaitable[dict[str, Any]]]


def from_disk(model_path: str, version: int) -> Loader:
    return lambda engine: engine.client.update_weights_from_disk(model_path, str(version))


def from_broadcast(body: DistributedWeightsIn, version: int) -> Loader:
    payload = body.model_dump(exclude_none=True)
    return lambda engine: engine.client.update_weights_from_distributed(payload, str(version))


def _loader_of(body: WeightsIn, version: int) -> tuple[Loader, str]:
    """How the engines get the weights ``body`` names, and what to call them in messages."""
    if body.distributed is not None:
        name = body.distributed.group_name
        return from_broadcast(body.distributed, version), f"the broadcast on {name!r}"
    return from_disk(str(body.model_path), version), str(body.model_path)


async def _load(engine: EngineState, loader: Loader) -> dict:
    try:
        result = await loader(engine)
    except EngineRejected as exc:  # the engine read the request and refused it
        return {"url": engine.url, "success": False, "message": str(exc), "refused": True}
    except EngineError as exc:
        return {"url": engine.url, "success": False, "message": str(exc)}
    return {"url": engine.url, "success": bool(result.get("success")), **result}


async def _check_files(model_path: str, seconds: float) -> None:
    """Refuse weights the engines could not read, before any engine pauses for them."""
    problem = await weight_files.problem(model_path, seconds)
    if problem is not None:
        message = f"The weights at {model_path!r} cannot be loaded: {problem}. "
        raise WeightsRefused(message + "No engine was paused.", "model_path", "weights_unreadable")


async def _load_within(
    engines: list[EngineState], loader: Loader, limit: float, source: str
) -> list[dict]:
    """Every engine's load result, if all are in within ``limit`` seconds; else the load is
    abandoned (the caller resumes the engines)."""
    try:
        return await asyncio.wait_for(asyncio.gather(*(_load(e, loader) for e in engines)), limit)
    except TimeoutError:
        log.warning("abandoned loading %s after %.0f s; the engines resume", source, limit)
        raise WeightUpdateFailed(
            f"The engines did not load {source} within {limit:g} s (--weights-pause-limit-s): "
            "the load was abandoned and the engines resumed serving.",
            code="weights_load_timeout",
        ) from None


async def publish(ctx: ServerContext, body: WeightsIn, source: int | None = None) -> WeightsOut:
    """Swap the weights ``body`` names into every engine in rotation, as a new version; or,
    asked to load from disk the version the run has and every engine serves, answer that
    without a swap (a caller's retry of a swap that was done, its answer lost). ``source``: the
    earlier version whose weights these are (a rollback, ``server.rl.rollback``)."""
    run_id, version = body.run_id, body.version
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id or ctx.default_run_id)
    if run is None:
        raise RunNotFound(run_id)
    version = run.policy_version + 1 if version is None else version
    pool = ctx.pool
    if body.distributed is None:
        await _check_files(str(body.model_path), ctx.settings.weights_check_timeout_s)
    async with pool.update_lock:
        await refuse_shared(ctx, run.id, lora=False)
        await promotion.refuse_full_weights(ctx, run.id)
        given = None if body.model_path is None else str(body.model_path)
        await refuse_superseded(ctx, run.id, version, given, source)
        engines = pool.loadable
        if body.distributed is None and await _served(ctx, run.id, version, str(body.model_path)):
            log.info("version %d is already served: nothing swapped", version)
            served = [
                {"url": e.url, "success": True, "message": "already serving"} for e in engines
            ]
            return WeightsOut(
                run_id=run.id, policy_version=version, engines=served, pause_seconds=0.0
            )
        if not engines:
            raise NoEngineToUpdate("No engine is in rotation to load the weights.")
        started = time.perf_counter()
        paused: list[BaseException | None] = []  # each engine's pause, once it was sent
        try:
            lead = await _pause(ctx, engines, paused)
            pool.last_swap = None  # until this one is known to be done
            results = await _swap(ctx, engines, body, run.id, version, lead, source)
        finally:
            if paused:
                _resume_failed(engines, await _resume(ctx, engines))
        pause_seconds = time.perf_counter() - started
        pool.expected_version = version
        _after_swap(pool, engines, paused, results, version)
    swap = {"run_id": run.id, "version": version, "pause_seconds": pause_seconds, "at": time.time()}
    pool.swaps.append(swap)
    pool.last_swap = (run.id, version)
    ctx.metrics.weight_swap_pause_seconds.observe(pause_seconds)
    await ctx.admission.notify()
    log.info("published version %d (paused %.3fs)", version, pause_seconds)
    return WeightsOut(
        run_id=run.id, policy_version=version, engines=results, pause_seconds=pause_seconds
    )


def _resume_failed(engines: list[EngineState], answers: list[BaseException | None] | None) -> None:
    """Engines whose swap's resume was sent and failed (not answered in time, refused) may be
    paused still: kept as a pause no resume followed, for the leader to resume again
    (``heal_pauses``)."""
    for engine, error in zip(engines, answers or [], strict=False):
        if error is not None and engine.late_pause is None:
            ended: asyncio.Future = asyncio.get_running_loop().create_future()
            ended.set_result(None)
            engine.late_pause = ended


def _after_swap(
    pool: EnginePool,
    engines: list[EngineState],
    paused: list[BaseException | None],
    results: list[dict],
    version: int,
) -> None:
    """Each engine after a swap: in rotation at ``version`` where it paused and loaded; else
    out, with why. One whose pause was not answered in time may apply it yet, after the swap's
    resume: kept (``late_pause``) for the leader to resume again (``heal_pauses``)."""
    for engine, pause_error, result in zip(engines, paused, results, strict=True):
        if isinstance(pause_error, Exception):
            problem = first_line(pause_error) if str(pause_error) else "it did not answer in time"
            pool.mark_down(engine, f"weight update failed: its pause failed: {problem}")
        elif not result["success"]:
            pool.mark_down(engine, f"weight update failed: {result.get('message')}")
        else:  # in rotation again if it served another version
            engine.weight_version, engine.healthy, engine.off_version = (str(version), True, False)
            engine.off_version_cause = None


async def refuse_shared(ctx: ServerContext, run_id: str, lora: bool) -> None:
    """``EnginesShared`` where a publish for ``run_id`` (``lora``: of an adapter; else of full
    weights) would put both kinds on the engines: an adapter is trained on the base model and
    served on it, and full weights replace the base for every request."""
    async with ctx.sessionmaker() as db:
        others = [r for r in await runs.published_runs(db, lora=not lora) if r.id != run_id]
    if not others:
        return
    named = ", ".join(f"{r.id} (version {r.policy_version})" for r in others[:3])
    own = "Serve each kind on engines of its own (a proxrl serve with its own engines)."
    if lora:
        raise EnginesShared(
            f"The engines serve full weights published by run {named} in place of the base "
            f"model, and a LoRA adapter runs on the base model: nothing was loaded. {own}",
            "adapter_path",
        )
    raise EnginesShared(
        f"LoRA runs serve their adapters on these engines' base model ({named}), and full "
        f"weights would replace it under them: nothing was swapped. {own}",
        "model_path",
    )


async def refuse_superseded(
    ctx: ServerContext, run_id: str, version: int, path: str | None, source: int | None = None
) -> None:
    """``VersionSuperseded`` for a publish under a number the run has passed, or under its
    current number where that is a rollback's and ``path`` other weights than it serves: a
    trainer that has not yet seen a rollback publishes the number after its own last one, and
    recording it would rewrite the lineage. A rollback (``source``) must be the very next
    version: a publish that landed after the rollback read the run's version took its number.
    Read under the update lock, so no publish or rollback lands between this and the record."""
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
        current = None if run is None else await run_versions.get(db, run_id, version)
    if run is None:
        return
    if source is not None and version != run.policy_version + 1:
        raise VersionSuperseded(
            f"Run {run_id} went on to version {run.policy_version} while the rollback to version "
            f"{source} was prepared: nothing was loaded. Roll back again if it is still wanted."
        )
    taken = current is not None and current.source is not None and run.weights_path != path
    if version < run.policy_version or (version == run.policy_version and taken):
        raise VersionSuperseded(
            f"Run {run_id} is at version {run.policy_version} (see GET /rl/runs/{run_id}/"
            f"versions: a rollback made an earlier version current again), so version {version} "
            "cannot be published: nothing was loaded. Publish the run's policy_version + 1, "
            "from weights that descend from the version it serves."
        )


async def _served(ctx: ServerContext, run_id: str, version: int, model_path: str) -> bool:
    """Whether the run's recorded version is ``version`` and every engine in rotation, and none
    out of it for its version, serves it (read under the update lock: a swap to it that was
    still running when this request came is over). Not for a broadcast, whose sender waits for
    the engines to receive it.

    Served, yet loaded from other weights than ``model_path`` names (the run recorded another
    path for it, or the last swap was another run's to the same number): ``WeightsConflict``,
    nothing swapped; a caller's retry names what it sent the first time. A replica that has
    swapped nothing since it took the lead knows the last swap by the store only: another run
    recording this version from another path is a conflict too."""
    engines = ctx.pool.loadable
    if not engines or ctx.pool.expected_version != version:
        return False
    if not all(e.healthy and e.weight_version == str(version) for e in engines):
        return False
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, run_id)
        if run is None or run.policy_version != version:
            return False
        others = [
            o
            for o in await runs.others_at_version(db, version, run_id)
            if o.weights_path != model_path
        ]
    refusal = f"The engines serve version {version}, but"
    if run.weights_path != model_path:
        raise WeightsConflict(
            f"{refusal} run {run_id} loaded it from {run.weights_path!r}, not {model_path!r}: "
            f"nothing was swapped. {_NEW_VERSION}"
        )
    last = ctx.pool.last_swap
    if last is not None and last != (run_id, version):
        raise WeightsConflict(
            f"{refusal} the last swap was run {last[0]}'s to version {last[1]}, "
            f"not run {run_id}'s: nothing was swapped. {_NEW_VERSION}"
        )
    if last is None and others:
        raise WeightsConflict(
            f"{refusal} run {others[0].id} also records it, from {others[0].weights_path!r}: "
            f"which weights the engines serve is not known here, so nothing was swapped. "
            f"{_NEW_VERSION}"
        )
    return True


_NEW_VERSION = (
    "To load these weights, publish a new version (omit version, or send the run's "
    "policy_version + 1)."
)


async def _swap(
    ctx: ServerContext,
    engines: list[EngineState],
    body: WeightsIn,
    run_id: str,
    version: int,
    lead: LeadToken,
    earlier: int | None,
) -> list[dict]:
    """With the engines paused: load the weights and record the version, if this replica still
    leads, under the same lead (``lead``) as when it paused them (else nothing is recorded: the
    engines resume, and the replica that leads now loads them when the caller retries). The
    record comes before the engines resume, so no replica sees them serve a version the store
    does not have yet."""
    await _failpoint("paused")
    await confirm_lead(ctx, f"nothing was loaded; {_RESUMED}", lead)
    loader, source = _loader_of(body, version)
    size_bytes = await weight_files.size(body.model_path and str(body.model_path))
    results = await _load_within(engines, loader, ctx.settings.weights_pause_limit_s, source)
    if not any(r["success"] for r in results):  # nothing changed: no engine is to blame
        message = f"No engine loaded {source}: {results[0].get('message')}"
        if all(r.get("refused") for r in results):
            raise WeightsRefused(message, "model_path" if body.model_path else "distributed")
        raise WeightUpdateFailed(message)
    await confirm_lead(
        ctx,
        f"the engines loaded {source} but version {version} was not recorded; {_RESUMED}, "
        "and the leader keeps them out of rotation until it loads them",
        lead,
        record=lambda db: runs.set_policy_version(
            db,
            run_id,
            version,
            body.model_path,
            source=earlier,
            size_bytes=size_bytes,
            retention=retention(ctx),
        ),
    )
    return results


def retention(ctx: ServerContext) -> run_versions.Retention:
    """How many versions of a run stay pinnable, and how many bytes (``--versions-kept``,
    ``--versions-max-mb``)."""
    settings = ctx.settings
    return run_versions.Retention(settings.versions_kept, int(settings.versions_max_mb * 2**20))


# The most a check of the lead (and the version's record with it) may take. The engines may be
# paused meanwhile, so a store that is slow or away must not hold them: this is the election's
# own bound on the store (a leader whose store does not answer within it steps down anyway), and
# more than the lock wait its transaction allows (leadership.LEADS_LOCK_S), so a lock held
# elsewhere ends as Postgres's error, the transaction rolled back, before this cuts it off.
STORE_WAIT_S = leadership.QUERY_TIMEOUT_S


LeadToken = tuple[int, Any]


async def confirm_lead(
    ctx: ServerContext,
    then: str,
    lead: LeadToken | None = None,
    record: Callable[[Db], Awaitable[None]] | None = None,
    hold_s: float = 0.0,
) -> LeadToken:
    """This replica still leads (by its last election check and by the store), or 503; its
    lead's fencing token. With ``lead``, under that same lead (one lost and taken again since,
    even by this replica, is another: 503); with ``record``, what it does in the transaction
    that found it leading (the leader row locked: see ``leadership.locked_leader``; ``hold_s``,
    how long of it may be spent away from the store). A store that fails or takes more than
    STORE_WAIT_S (plus ``hold_s``) counts as a lost lead (nothing recorded)."""
    # SQLite: the one server always leads, and waits on a lock as long as its busy timeout
    shared = database.is_shared(ctx.settings.database_url)
    bound = STORE_WAIT_S + hold_s if shared else None
    if ctx.pool.leading:
        try:
            async with asyncio.timeout(bound), ctx.sessionmaker() as db, db.begin():
                token = await leadership.lead_token(db, ctx.replica_id, hold_s)
                if token is not None and (lead is None or lead == token):
                    if record is not None:
                        await record(db)
                    return token
        except Exception as exc:  # slow, locked, or away: this replica cannot act as leader
            if not isinstance(exc, TimeoutError) and database.store_fault(exc) is None:
                raise  # a bug or a refused value, not the store's state: not a lost lead
            problem = "no answer" if isinstance(exc, TimeoutError) else first_line(exc)
            log.warning("the store did not confirm the lead within %g s: %s", STORE_WAIT_S, problem)
            raise _lost_lead(
                f"{then} (the store did not confirm the lead within {STORE_WAIT_S:g} s: {problem})"
            ) from None
    raise _lost_lead(then)


# How long an engine may take to answer a pause or a resume sent while the leader row is held
# locked (``_pause``, ``_resume``): a replica taking the lead waits for the row meanwhile. An
# engine that has not answered by then counts as failed to pause (out of rotation after the swap).
FENCED_CALL_S = 5.0


async def _tell(
    engines: list[EngineState],
    call: Callable[[EngineState], Awaitable[None]],
    seconds: float | None,
) -> list[BaseException | None]:
    """``call`` on every engine at once, each within ``seconds``: each one's error, or None."""

    async def one(engine: EngineState) -> BaseException | None:
        try:
            async with asyncio.timeout(seconds):
                await call(engine)
        except Exception as exc:
            return exc
        return None

    return await asyncio.gather(*map(one, engines))


async def _pause_engines(
    engines: list[EngineState], seconds: float | None
) -> list[BaseException | None]:
    """Pause every engine at once, each within ``seconds``: each one's error, or None. A pause
    not answered by then is not called off (the engine may have it and apply it yet, after the
    swap's resume): it goes on, kept on the engine (``late_pause``), and once it has ended the
    leader resumes the engine again (``heal_pauses``)."""
    calls = [asyncio.ensure_future(e.client.pause("abort")) for e in engines]
    for engine, call in zip(engines, calls, strict=True):
        engine.late_pause = call  # until it is known to have ended in time
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
    await asyncio.wait(calls, timeout=seconds)
    errors: list[BaseException | None] = []
    for engine, call in zip(engines, calls, strict=True):
        if not call.done():
            errors.append(TimeoutError(f"its pause was not answered within {seconds:g} s"))
            continue
        engine.late_pause = None
        errors.append(asyncio.CancelledError() if call.cancelled() else call.exception())
    return errors


async def _pause(
    ctx: ServerContext, engines: list[EngineState], paused: list[BaseException | None]
) -> LeadToken:
    """Pause every engine (``abort`` mode), in the transaction that finds this replica leading,
    the leader row locked: a replica that takes the lead after, and resumes the engines as it
    does (``server.startup.take_part``), resumes them after this pause, never before it. Fills
    ``paused`` (each engine's error, or None) once the pause is sent; the lead's token."""

    async def pause(_db: Db) -> None:
        paused.extend([None] * len(engines))  # sent, whatever comes of it
        paused[:] = await _pause_engines(engines, FENCED_CALL_S)

    if not database.is_shared(ctx.settings.database_url):  # one server: it always leads
        lead = await confirm_lead(ctx, "no engine was paused")
        paused.extend([None] * len(engines))
        paused[:] = await _pause_engines(engines, None)
        return lead
    try:
        return await confirm_lead(ctx, "no engine was paused", record=pause, hold_s=FENCED_CALL_S)
    except NoLeader:
        if not paused:
            raise
        raise _lost_lead(f"nothing was loaded; {_RESUMED}") from None


async def _resume(
    ctx: ServerContext, engines: list[EngineState]
) -> list[BaseException | None] | None:
    """Resume the engines a swap paused, unless another replica leads now, in a transaction
    that holds the leader row locked until the engines have answered. A replica that lost the
    lead mid-swap must not resume them: the one that leads now resumed them as it took the lead
    and may have paused them since for a swap of its own, which the resume would break into
    (requests sampled from half-loaded weights, under a version that did not sample them). With
    the row locked, no replica takes the lead, and so none pauses for a swap, until the resume
    is answered. No replica leading (the lead lost, none taken yet): resumed, as the replica
    that takes the lead next waits for the row.

    A store that does not answer within its bound leaves the engines paused: this replica
    stops leading until its next election check (``server.startup.take_part``), which, if it
    still holds the lead, takes it again and resumes them as any takeover does; if it does not,
    the replica that takes the lead does. SQLite: the one server always leads, and resumes.

    Returns each engine's error, or None, where the resume was sent; None where it was not."""
    if not database.is_shared(ctx.settings.database_url):
        return await _tell(engines, lambda e: e.client.resume(), None)
    sent: list[BaseException | None] | None = None
    try:
        # Three bounds, one after the other: the store's answer, the engines' (each call its
        # own, so no bound cuts a resume short while it is reported sent), the commit's.
        async with (
            asyncio.timeout(2 * STORE_WAIT_S + FENCED_CALL_S),
            ctx.sessionmaker() as db,
            db.begin(),
        ):
            async with asyncio.timeout(STORE_WAIT_S):
                leader = await leadership.locked_leader(db, hold_s=FENCED_CALL_S)
            if leader is not None and leader[0] != ctx.replica_id:
                log.warning(
                    "the engines stay paused: replica %s leads now (it resumed them as it took "
                    "the lead, and a swap of its own may hold them)",
                    leader[0],
                )
                ctx.pool.leading = False  # this replica follows it
                return None
            sent = await _tell(engines, lambda e: e.client.resume(), FENCED_CALL_S)
        return sent
    except Exception as exc:  # slow, locked, away, or a bug: whether another leads is unknown
        problem = "no answer" if isinstance(exc, TimeoutError) else first_line(exc)
    if sent is not None:  # resumed under the lock; only its end failed
        log.warning("resumed the engines; the store's transaction then failed: %s", problem)
        return sent
    log.warning(
        "the engines stay paused: the store did not say who leads within %g s (%s); this "
        "replica follows until its next leader check, which resumes them if it still leads",
        STORE_WAIT_S,
        problem,
    )
    # The last statement before the caller's update lock is released (no await between): the
    # election's next round sees a lead to take, with no swap under way, and resumes them.
    ctx.pool.leading = False
    return None


def _pause_ended(engine: EngineState) -> bool:
    return engine.late_pause is not None and engine.late_pause.done()


def late_pauses_ended(pool: EnginePool) -> bool:
    """Whether an engine that answers its health checks may hold a pause no resume followed
    (``heal_pauses``' work): one not answered in time that has ended since, or one whose swap's
    resume failed. An engine that does not answer is left until it does (no resume every
    check, each holding the swap lock, to an engine that cannot take it)."""
    return any(e.healthy and _pause_ended(e) for e in pool.engines)


async def heal_pauses(ctx: ServerContext) -> None:
    """Resume, fenced (``_resume``), the engines whose swap pause was not answered in time and
    has ended since (``EngineState.late_pause``: applied after the swap's resume, it would hold
    the engine's requests until the next swap), once no swap of this replica's is under way and
    while it leads. Each leader check of a leading replica runs it where such an engine is."""
    pool = ctx.pool
    async with pool.update_lock:
        ended = [e for e in pool.engines if e.healthy and _pause_ended(e)]
        if not ended or not pool.leading:
            return
        answers = await _resume(ctx, ended) or []
        for engine, error in zip(ended, answers, strict=False):
            if error is None:  # resumed after the pause: it is spent
                engine.late_pause = None


async def resume_after_swap(ctx: ServerContext) -> None:
    """Resume every engine once this replica's swap under way is over (its update lock free), if
    this replica still leads: what a replica taking the lead does (``server.startup.take_part``)
    while a swap of its own holds that lock. A swap that ran resumed them already (resuming an
    engine that is not paused does nothing); one refused before it paused them (a check of the
    run, of the lead) would otherwise leave them as a leader that died mid-swap left them,
    paused, until the next swap. Fenced as a swap's own resume (``_resume``)."""
    async with ctx.pool.update_lock:
        if ctx.pool.leading:
            await _resume(ctx, ctx.pool.engines)


# What comes of engines a swap paused when the swap loses the lead (``_resume``).
_RESUMED = "the engines resume, by this replica's hand or the one that leads now"


def _lost_lead(then: str) -> NoLeader:
    return NoLeader(
        f"this replica stopped leading during the swap: {then}. Nothing was recorded: retry "
        "(with the same version) in a moment, and the replica that leads now swaps.",
        code="lost_leadership",
    )


# Tests only: PROXRL_WEIGHTS_FAILPOINT=paused:<seconds> makes a publish sleep that long with the
# engines paused and nothing loaded, so that a test can take the lead away or kill the leader
# there. Unset (always, outside tests): one dictionary lookup.
FAILPOINT = "PROXRL_WEIGHTS_FAILPOINT"


async def _failpoint(point: str) -> None:
    named, _, seconds = os.environ.get(FAILPOINT, "").partition(":")
    if named == point:
        log.warning("failpoint %s: sleeping %s s", point, seconds)
        await asyncio.sleep(float(seconds))


# torch.distributed's TCPStore protocol (c10d/TCPStore.cpp): a client validates with a magic
# number, then PING carries a nonce the store sends back.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
# How long a store that accepted the connection may take to answer the ping.
RENDEZVOUS_PING_S = 3.0


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
    """None once a torch.distributed store answers at ``host:port`` (rank 0's, which the trainer
    starts as it asks the engines to join), else why none did: nothing accepted a connection
    within ``wait_s``, or what accepted it did not answer a store's ping within
    ``RENDEZVOUS_PING_S``.

    Engines asked to join an address where no store answers would block in their rendezvous for
    many minutes, so the caller's address is checked here first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            connecting = asyncio.open_connection(host, port)
            reader, writer = await asyncio.wait_for(connecting, max(deadline - loop.time(), 0.1))
        except socket.gaierror as exc:
            return f"the host {host!r} does not resolve ({exc.strerror})"
        except (OSError, TimeoutError, ValueError) as exc:
            if loop.time() + 0.2 >= deadline:
                return f"nothing accepted a connection at {host}:{port} within {wait_s:g} s ({exc})"
            await asyncio.sleep(0.2)
            continue
        try:
            return await _store_problem(reader, writer, host, port)
        finally:
            writer.close()


async def _store_problem(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
) -> str | None:
    nonce = secrets.randbits(32) | 1  # never 0: nothing read is not an echo
    writer.write(struct.pack("<BIBI", _VALIDATE, _MAGIC, _PING, nonce))
    try:
        await writer.drain()
        answer = await asyncio.wait_for(reader.readexactly(4), RENDEZVOUS_PING_S)
    except TimeoutError:
        answer = None
    except (OSError, asyncio.IncompleteReadError):
        answer = b""
    if answer and struct.unpack("<I", answer)[0] == nonce:
        return None
    seen = "no answer" if answer is None else f"the answer {answer!r}" if answer else "a close"
    return (
        f"{host}:{port} accepts connections but is not a torch.distributed store "
        f"({seen} to its ping within {RENDEZVOUS_PING_S:g} s)"
    )


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


# Set on a request a follower forwards: the replica it reaches answers it or refuses it (503),
# never forwards it again (a lead that moved meanwhile would otherwise bounce it around).
FORWARDED_HEADER = "x-proxrl-forwarded-by"
FORWARDED_HEADERS = ("authorization", "x-api-key")  # the caller's key, which the leader checks
LEADER_CONNECT_S = 5.0
_RETRY_SAME = (
    "retry with the same version (the run's policy_version + 1 when this one was sent): a swap "
    "to the version the run already serves answers 200 without swapping again"
)


@dataclass(frozen=True)
class Forwarded:
    """The leader's answer, to be returned as is."""

    status: int
    content: bytes
    headers: dict[str, str]


def forward_limit(ctx: ServerContext) -> float:
    """How long a forwarded swap may take: the leader's own bounds on checking the files and
    on the pause, and a margin for recording the version."""
    settings = ctx.settings
    return settings.weights_check_timeout_s + settings.weights_pause_limit_s + 30.0


async def forward(
    ctx: ServerContext, path: str, body: BaseModel, headers: Mapping[str, str]
) -> Forwarded:
    """Send a weights request that reached a follower to the leader, with the caller's key.
    ``NoLeader`` (503, Retry-After) when no replica leads, the leader cannot be reached, or it
    broke off (``leader_lost``: it died mid-swap); 502 ``leader_timeout`` when it took the
    request and did not answer in time. After either of the last two the swap may have been
    done: a retry with the same ``version`` is answered without a second swap (``publish``)."""
    if headers.get(FORWARDED_HEADER):
        raise NoLeader(
            "this replica received a forwarded swap but does not lead (the lead moved); "
            "retry in a moment.",
            code="no_leader",
        )
    async with ctx.sessionmaker() as db:
        leader = await leadership.current_leader(db)
    if leader is None or leader.replica_id == ctx.replica_id:
        raise NoLeader(
            "no replica leads right now (the last leader stopped; another takes over within "
            "about --leader-check-s); retry in a moment.",
            code="no_leader",
        )
    limit = forward_limit(ctx)
    sent = {name: headers[name] for name in FORWARDED_HEADERS if name in headers}
    sent |= {FORWARDED_HEADER: ctx.replica_id, "content-type": "application/json"}
    url = f"{leader.url}{path}"
    try:
        async with (
            asyncio.timeout(limit + LEADER_CONNECT_S),
            httpx.AsyncClient(timeout=httpx.Timeout(limit, connect=LEADER_CONNECT_S)) as http,
        ):
            answer = await http.post(
                url, content=body.model_dump_json(exclude_unset=True), headers=sent
            )
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise NoLeader(
            f"the leader {leader.replica_id} at {leader.url} could not be reached ({exc!r}); "
            "if it is gone another replica takes over: retry in a moment.",
            code="leader_unreachable",
        ) from None
    except (httpx.TimeoutException, TimeoutError) as exc:
        raise WeightUpdateFailed(
            f"The leader {leader.replica_id} at {leader.url} did not answer within {limit:g} s "
            f"({exc!r}); the swap may have been done, or may still be: {_RETRY_SAME}",
            code="leader_timeout",
        ) from None
    except httpx.HTTPError as exc:  # it broke off: it died, or stopped, mid-swap
        raise NoLeader(
            f"the leader {leader.replica_id} at {leader.url} broke off ({exc!r}); the swap may "
            f"have been done: {_RETRY_SAME}",
            code="leader_lost",
        ) from None
    kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
    return Forwarded(answer.status_code, answer.content, kept)
