"""Build the server's resources at start and release them at stop (the app's lifespan).

In order: migrate the store, load the tokenizer, start engines (embedded or SGLang, unless
--engines names running ones), check the engines, load the secret that signs dashboard logins
(made once per store), make sure the default run exists (a new one's key is printed once to the
terminal, never logged) and the engines serve its current version, then keep applying session
deadlines in the background.

Before any of that, ``first_problem`` checks what would stop it once started (the model
directory, the store's URL, the data folder, the address, a connection to the store), so
``proxrl serve`` can refuse in one line that names the flag before it creates a data folder, a
store or an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from server.common.key_handover import hand_over
from server.common.processes import EngineProcess, ServerProcess, wait_all
from server.context import ServerContext
from server.engine.settings import model_directory_problem
from server.engine_client import sglang
from server.engine_client.adapters import AdapterLoads
from server.engine_client.pool import EnginePool, EngineState, parse_version
from server.errors import EngineError, StoreUnavailable
from server.metrics import Metrics
from server.proxy.session_cache import SessionRegistry
from server.rl import weights
from server.settings import ServerSettings
from server.store import database, runs
from server.store import secrets as store_secrets
from server.store import sessions as store_sessions
from server.store.byte_lru import MB, ByteLRU
from server.store.keys import hash_key
from server.store.leadership import Election
from server.store.run_adapters import RunAdapters
from server.store.run_config import RunConfig, RunConfigs
from server.store.tables import Run
from server.store.writer import TurnWriter
from server.text.tokenization import Tokenizer

log = logging.getLogger(__name__)

# Where a new default run's key goes when stdout is not a terminal (under --data-dir).
DEFAULT_RUN_KEY_FILE = "default-run-key"


def launch_embedded(settings: ServerSettings) -> list[EngineProcess]:
    """Start --num-engines embedded engines on loopback and wait until they serve."""
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Leave a core to the proxy: an engine whose OpenMP threads lose a core to it stalls.
    threads = max(1, ((os.cpu_count() or 1) - 1) // settings.num_engines)
    engines = [
        EngineProcess(
            settings.model, logs / f"engine-{index}.log", *embedded_flags(settings, threads)
        )
        for index in range(settings.num_engines)
    ]
    wait_all(engines)
    log.info("started %d embedded engine(s): %s", len(engines), [e.url for e in engines])
    return engines


# What --engine names: how proxrl starts such engines when no --engines are given.
def embedded_flags(settings: ServerSettings, threads: int) -> list[str]:
    """The flags of each embedded engine proxrl starts."""
    return [
        "--incremental-streaming-output",
        *("--max-running-requests", str(settings.engine_max_running_requests)),
        *("--num-threads", str(threads)),
        *("--max-loaded-loras", str(settings.max_loaded_loras)),
    ]


def lora_limits(settings: ServerSettings) -> sglang.LoRALimits | None:
    """What launched SGLang servers are sized for to serve LoRA runs (None: no adapters)."""
    if settings.lora_max_rank == 0:
        return None
    return sglang.LoRALimits(
        max_rank=settings.lora_max_rank,
        target_modules=tuple(settings.lora_target_modules),
        max_loaded=settings.max_loaded_loras,
        max_per_batch=settings.max_loras_per_batch,
    )


def launch_sglang(settings: ServerSettings) -> list[sglang.SGLangProcess]:
    """Start --num-engines SGLang servers, serving LoRA runs' adapters with --lora-max-rank."""
    return sglang.launch(settings, lora_limits(settings))


LAUNCHERS: dict[str, Callable[[ServerSettings], Sequence[ServerProcess]]] = {
    "embedded": launch_embedded,
    "sglang": launch_sglang,
}


async def ensure_default_run(ctx: ServerContext) -> Run:
    key: str | None = None
    async with ctx.sessionmaker() as db, db.begin():
        run = await runs.default_run(db)
        if run is None:
            config = RunConfig().model_dump()
            run, key = await runs.create_run(db, "default", ctx.model_name, config, True)
    if key is not None:
        log.info("created the default run %s", run.id)
        # For the person at the terminal, once; never into a log.
        line = f"default run {run.id}, run key (shown once)"
        hand_over(line, key, ctx.settings.data_dir / DEFAULT_RUN_KEY_FILE)
    return run


def engine_version(run: Run) -> int:
    """The version of the weights the engines serve for ``run``: its policy version for a run of
    full weights; 0 for a LoRA run, whose versions are adapters on the served base model (an
    adapter publish leaves the engines' weights, and their version, as they were)."""
    return 0 if run.lora else run.policy_version


async def start_engines(ctx: ServerContext, election: Election, run: Run) -> None:
    """At start: lead or follow, and, leading, have the engines serve what the store says. A
    first leader over Postgres may find engines a dead one left paused (``take_part``); a SQLite
    store's one process leads from the start, with no takeover, expects what a takeover would
    (``version_on_takeover``) and resumes the engines as one does (a server killed mid-swap left
    them paused). The store's read is not bounded here: the load of the run's version follows."""
    pool = ctx.pool
    pool.leading = not election.postgres
    if pool.leading:  # resumed after the load below (a server killed mid-swap left them paused)
        pool.expected_version = await version_on_takeover(ctx)
        pool.in_background(weights.resume_after_swap(ctx))
    await take_part(ctx, election, store_wait_s=None)
    if pool.leading:  # a follower loads nothing: the leader does
        await serve_current_version(ctx, run)


async def serve_current_version(ctx: ServerContext, run: Run) -> None:
    """Engines that came up with other weights than the run's version load that version. A run
    at version 0 with no weights path (one that has published nothing; a LoRA run, whose engines
    serve the base model) serves the base model: an engine found serving a version no run records
    (left by a deployment whose store is gone, say) is reset to it (``reset_to_base``). Engines
    that all serve a version another run records (its swap was the last: ``version_on_takeover``,
    which set the pool's expected version to it) keep it, on either store."""
    wanted = engine_version(run)
    if ctx.pool.expected_version not in (None, wanted):
        return  # the last swap was another run's, and every engine serves it
    weights_path = None if run.lora else run.weights_path  # a LoRA run's is its adapter's
    # Held so that no health check judges an engine mid-load; ``loadable``: a check may already
    # have taken one serving another version out of rotation.
    async with ctx.pool.update_lock:
        for engine in ctx.pool.loadable:
            served = parse_version(engine.weight_version or "")
            if served == wanted:
                continue
            if weights_path is not None:
                await engine.client.update_weights_from_disk(weights_path, str(wanted))
                engine.weight_version = str(wanted)
            elif wanted == 0:
                if not await version_recorded(ctx, served):
                    await reset_to_base(ctx, engine)
            else:
                log.warning(
                    "engine %s serves %s, the run is at %s with no weights path",
                    engine.url,
                    engine.weight_version,
                    wanted,
                )


async def reset_to_base(ctx: ServerContext, engine: EngineState) -> None:
    """Load the base model (``--model``, what a rollback to version 0 loads) into ``engine`` as
    version 0, back in rotation; if the engine cannot, it stays out of rotation, and the reason
    (the health checks' and ``/admin/engines``') says why and what to do. The engine's own
    ``model_path`` is no guide: a load from disk changes it to the loaded folder's."""
    served, base = engine.weight_version, ctx.settings.model
    try:
        answer = await engine.client.update_weights_from_disk(base, "0") or {}
        problem = None if answer.get("success", True) else str(answer.get("message"))
    except (EngineError, ValueError, AttributeError) as exc:  # refused, down, or no JSON object
        problem = str(exc) or type(exc).__name__
    if problem is None:
        log.warning(
            "engine %s served version %s, which no run in this store records, where the default "
            "run's engines serve version 0 (the base model): reset it to the base model %s",
            engine.url,
            served,
            base,
        )
        engine.weight_version, engine.healthy, engine.off_version = "0", True, False
        engine.off_version_cause = None
        return
    cause = (
        f"weights no run in this store records; resetting it to the base model {base} failed "
        f"({problem}): restart the engine on its base model, or publish weights "
        "(POST /admin/weights)"
    )
    engine.off_version_cause = (str(served), cause)
    ctx.pool.mark_off_version(engine, str(served), 0)


def replica_id() -> str:
    """This process's name among the replicas: host, pid, and a few random bytes (a pid is
    reused across restarts)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


async def store_version(ctx: ServerContext) -> int | None:
    """The version the default run's engines serve, as the store has it (what a follower's
    engines serve)."""
    async with ctx.sessionmaker() as db:
        run = await runs.get_run(db, ctx.default_run_id)
    return None if run is None else engine_version(run)


async def version_recorded(ctx: ServerContext, version: int) -> bool:
    """Whether some run of full weights is at policy version ``version`` (an engine a follower
    may keep; a LoRA run's versions are adapters, never the engines' weights). Not version 0: a
    run there has published nothing, and an engine there serves the model it started with (one
    restarted, say), which only the default run's 0 makes current."""
    if version <= 0:
        return False
    query = select(Run.id).where(Run.policy_version == version, Run.lora.is_(False)).limit(1)
    async with ctx.sessionmaker() as db:
        found = await db.execute(query)
    return found.first() is not None


async def version_on_takeover(ctx: ServerContext) -> int | None:
    """The version a replica taking the lead expects: the one every engine in its rotation
    serves, when some run records it (the last swap may have been another run's than the
    default, whose engines this replica kept as a follower); else the default run's."""
    served = {parse_version(e.weight_version) for e in ctx.pool.healthy if e.weight_version}
    if len(served) == 1 and await version_recorded(ctx, next(iter(served))):
        return served.pop()
    return await store_version(ctx)


@contextlib.contextmanager
def kept_out_of_collections() -> Iterator[None]:
    """Move what the process holds once started (the libraries' modules and objects, the
    tokenizer, the store's and the pool's machinery: some 330,000 objects) out of the garbage
    collector's reach. A full collection walks every tracked object, with the event loop held:
    about 0.2 s here, every couple of thousand requests, during which no request of any client
    moves. What is frozen lives as long as the server; the requests' own objects are collected
    as before, and a full collection walks only them. (No collection first: the little garbage
    the start left stays, once, rather than a 0.2 s walk at every start.) When the server stops,
    all of it is the collector's again."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def take_part(
    ctx: ServerContext, election: Election, store_wait_s: float | None = weights.STORE_WAIT_S
) -> None:
    """Take or keep the lead (``Election.check``); the pool leads or follows with it. A replica
    that takes over from a dead leader resumes every engine: one that died mid-swap left them
    paused (resuming an engine that is not paused does nothing). The resume is a swap's own
    (``weights.resume_after_swap``): once no swap of this replica's is under way (one may be
    refused before it pauses, and resume nothing), and fenced by the store, so a replica whose
    lead moved on while it took it does not resume engines the new leader paused for its swap.
    The store's reads here are bounded (``store_wait_s``; not at start, where the load of the
    run's version follows): a store too slow to say what the engines should serve leaves the lead
    to take at the next check. A leader resumes again, fenced, an engine that may
    have applied a swap's pause late (``weights.heal_pauses``)."""
    pool = ctx.pool
    leading = await election.check()
    if leading and not pool.leading:
        try:
            version = await asyncio.wait_for(version_on_takeover(ctx), store_wait_s)
        except TimeoutError:
            log.warning("the store did not say what the engines serve: the lead waits")
            return
        pool.leading = True  # whatever the engines answer: one that hangs is the pool's to judge
        pool.last_swap = None  # what the engines hold is known by the store only
        if version is not None:
            pool.expected_version = version
        pool.in_background(weights.resume_after_swap(ctx))
        log.info("took the lead: the engines are expected at version %s", version)
    elif pool.leading and not leading:
        pool.last_swap = None
        log.warning("now following: the engines' versions are read from the store")
    pool.leading = leading
    if leading and weights.late_pauses_ended(pool) and not pool.update_lock.locked():
        pool.in_background(weights.heal_pauses(ctx))


# How long a stopping server waits for a round of its loops under way to end before it cancels it.
LOOP_STOP_WAIT_S = 10.0


async def paused(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` or until the server is stopping; whether it is."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stopping.wait()
    return stopping.is_set()


async def stop_loops(stopping: asyncio.Event, tasks: Sequence[asyncio.Task | None]) -> None:
    """End the server's loops between rounds: a round cancelled inside a query leaves its SQLite
    connection to a close that can wait forever (SQLAlchemy's terminate path over aiosqlite: a
    test's teardown waited 300 s for it in CI). A round still under way after LOOP_STOP_WAIT_S
    (an engine slow to answer the lead's call) is cancelled, again until it ends."""
    stopping.set()
    running = {task for task in tasks if task is not None and not task.done()}
    if running:
        await asyncio.wait(running, timeout=LOOP_STOP_WAIT_S)
    for task in running:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)


async def lead(ctx: ServerContext, election: Election, stopping: asyncio.Event) -> None:
    """Every --leader-check-s: take or keep the lead (replicas sharing a PostgreSQL store)."""
    while not await paused(stopping, ctx.settings.leader_check_s):
        try:
            await take_part(ctx, election)
        except Exception:
            log.exception("the leader check failed")


async def sweep(ctx: ServerContext, stopping: asyncio.Event) -> None:
    """Apply session and reward deadlines every --sweep-interval-s seconds."""
    while not await paused(stopping, ctx.settings.sweep_interval_s):
        try:
            async with ctx.sessionmaker() as db, db.begin():
                changed = await store_sessions.expire(db)
        except StoreUnavailable:
            continue  # the store's health has logged the episode
        except Exception:
            log.exception("applying session deadlines failed")
            continue
        for session_id, status in changed.items():
            ctx.sessions.set_status(session_id, status)
        if changed:
            await ctx.admission.notify()


@contextlib.asynccontextmanager
async def server_context(
    settings: ServerSettings, metrics: Metrics | None = None
) -> AsyncIterator[ServerContext]:
    if settings.admin_key is None:
        raise ValueError("the server needs an admin key (serve() generates one)")
    url = settings.database_url
    claim = database.SingleServer(url)
    claim.acquire()  # StoreInUse: a second server on one SQLite file
    await asyncio.to_thread(database.upgrade, url)
    health = database.StoreHealth()
    db_engine = database.connect(url, health, settings.store_busy_timeout_s)
    writer_engine = database.connect_sync(url, health, settings.store_busy_timeout_s)
    maker = database.sessionmaker(db_engine, health)
    tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, settings.model)
    launcher = LAUNCHERS[settings.engine]
    launched = [] if settings.engine_urls else await asyncio.to_thread(launcher, settings)
    urls = settings.engine_urls or [engine.url for engine in launched]
    pool = EnginePool(urls, settings.request_timeout_s, settings.health_interval_s)
    metrics = metrics or Metrics()
    writer = TurnWriter(writer_engine, on_commit=metrics.store_write_seconds.observe, health=health)
    lookups = int(settings.lookup_cache_mb * MB)
    stopping = asyncio.Event()
    sweeper: asyncio.Task | None = None
    leader: asyncio.Task | None = None
    election = Election(url, replica_id(), settings.leader_url)
    try:
        await pool.start()
        writer.start()
        ctx = ServerContext(
            settings=settings,
            admin_key_hash=hash_key(settings.admin_key),
            dashboard_secret=await store_secrets.get_or_create(
                maker, store_secrets.DASHBOARD_COOKIE
            ),
            database=db_engine,
            sessionmaker=maker,
            writer=writer,
            pool=pool,
            tokenizer=tokenizer,
            sessions=SessionRegistry(maker, tokenizer, int(settings.session_cache_mb * MB)),
            run_configs=RunConfigs(maker, budget_bytes=lookups // 4),
            run_adapters=RunAdapters(maker),
            adapter_loads=AdapterLoads(settings.pinned_adapters_per_engine),
            model_name=settings.model_name,
            metrics=metrics,
            store_health=health,
            key_cache=ByteLRU(lookups // 2),
            unknown_keys=ByteLRU(lookups // 4),
            replica_id=election.replica_id,
        )
        metrics.state.ctx = ctx
        run = await ensure_default_run(ctx)
        ctx.default_run_id = run.id
        pool.expected_version = engine_version(run)
        pool.read_version = lambda: store_version(ctx)
        pool.recorded = lambda version: version_recorded(ctx, version)
        await start_engines(ctx, election, run)
        leader = asyncio.create_task(lead(ctx, election, stopping), name="proxrl-leader")
        sweeper = asyncio.create_task(sweep(ctx, stopping), name="proxrl-sweeper")
        with kept_out_of_collections():
            yield ctx
    finally:
        await stop_loops(stopping, (sweeper, leader))
        await election.close()  # the lead goes at once, not when the connection times out
        await writer.stop()
        await pool.stop()
        for engine in launched:
            await asyncio.to_thread(engine.stop)
        await db_engine.dispose()
        writer_engine.dispose()
        claim.release()


# ----- before anything is created ----------------------------------------------------------


def first_problem(settings: ServerSettings) -> str | None:
    """The first thing that would stop the server once started, as one line that starts with
    the flag to change; None when the checks pass."""
    checks: list[Callable[[ServerSettings], str | None]] = [
        model_problem,
        db_problem,
        data_dir_problem,
        port_problem,
        store_problem,
        single_server_problem,
    ]
    for check in checks:
        problem = check(settings)
        if problem is not None:
            return problem
    return None


def model_problem(settings: ServerSettings) -> str | None:
    """The proxy reads the tokenizer (``tokenizer.json``); the engines it starts itself (no
    --engines) also load ``config.json`` and the weights."""
    return model_directory_problem(settings.model, loads_weights=not settings.engine_urls)


def db_problem(settings: ServerSettings) -> str | None:
    problem = database.url_problem(settings.database_url)
    if problem is not None:
        return f"--db: {problem}"  # not the URL: it may hold a password
    store = database.sqlite_file(settings.database_url)
    if settings.db is not None and store is not None:
        return folder_problem(f"--db {settings.db}", store.parent)
    return None


def data_dir_problem(settings: ServerSettings) -> str | None:
    """--data-dir holds the default store and the logs of the engines proxrl starts."""
    if settings.db is not None and settings.engine_urls:  # nothing goes there
        return None
    return folder_problem(f"--data-dir {settings.data_dir}", settings.data_dir)


def folder_problem(flag: str, folder: Path) -> str | None:
    """Why ``folder`` cannot be made or written in (None: it can). A real probe, a folder made
    and removed at once: permission bits say nothing for root, nor for /proc or a read-only
    mount."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it" if existing == folder else existing
        return f"{flag}: {where} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".proxrl-probe-", dir=existing))
    except OSError as exc:
        return f"{flag}: cannot write in {existing} ({exc.strerror or exc})"
    return None


def store_problem(settings: ServerSettings) -> str | None:
    """Connect to the store as the migration at start will; a new SQLite file is made then."""
    url = settings.database_url
    store = database.sqlite_file(url)
    if store is not None and not store.exists():
        return None
    engine = database.connect_sync(url)
    try:
        with engine.connect():
            pass
    except DBAPIError as exc:  # the driver's reason, never the URL (it may hold a password)
        reason = next((line for line in str(exc.orig).splitlines() if line.strip()), "")
        return f"--db: cannot open the store: {reason.strip() or type(exc.orig).__name__}"
    finally:
        engine.dispose()
    return None


def single_server_problem(settings: ServerSettings) -> str | None:
    """A SQLite store is served by one process (``database.SingleServer``)."""
    problem = database.SingleServer(settings.database_url).problem()
    return None if problem is None else f"--db: {problem}"


def port_problem(settings: ServerSettings) -> str | None:
    """Bind every address uvicorn will (asyncio's create_server: each address the host resolves
    to, "" for all of them, SO_REUSEADDR, IPv6 sockets IPv6-only), then let them go."""
    try:
        addresses = socket.getaddrinfo(
            settings.host or None, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"--host {settings.host}: not an address this machine knows ({exc.strerror})"
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        host = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
        where = f"{host}:{settings.port}"
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"--port {settings.port}: {where} is in use; choose another port"
                if exc.errno == errno.EACCES:
                    return f"--port {settings.port}: not allowed to bind {where} (ports below 1024)"
                return f"--host {settings.host}: cannot bind {where} ({exc.strerror or exc})"
    return None
