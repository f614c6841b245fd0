"""The engines behind the proxy: health, load, and which one serves the next request.

Routing: the least-loaded healthy engine (requests in flight through this proxy), except that a
session stays on the engine that served its last turn (prefix caches) while that engine is
healthy and not clearly busier than the rest. An engine that fails a request or a health check
leaves the rotation until a health check succeeds again.

Versions: the proxy that leads (the only one, or the leader of replicas sharing a store) keeps an
engine in rotation only while it serves ``expected_version``, which its own weight swaps set. A
follower swaps nothing: each health round it reads the version from the store (``read_version``)
and keeps an engine in rotation only while it serves that version or one above 0 the store
records as another run's (``recorded``: the leader's last swap may have been another run's); it
never pauses, loads or resumes an engine. The leader records a swap's version before it resumes
the engines, so an engine seen loaded a moment before that record is kept, for at most one and
a half health intervals; one still unrecorded then (a load that was abandoned and finished
late, a swap whose leader lost the lead) is off-version, as on the leader, so no replica serves
tokens under a version the store never recorded for longer than that.

An engine enters the rotation only once its context length is known (SGLang 0.5.23 reports it
in ``/v1/models``, not ``/server_info``: docs/architecture/sglang-protocol.md, "Context
length"): requests are sized against it. This module knows nothing about sessions, chat or the
store.

Adapters: which engine holds which LoRA adapter, and loading it there, is
``server.engine_client.adapters``'s: the health check knows nothing of adapters, so that an
engine holds an adapter before it serves a request for it is the request path's to ensure (it
loads the adapter there first).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from server.engine_client.client import EngineClient
from server.errors import EngineError, EngineRejected, NoEngineAvailable

log = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # a session's engine may have this many more requests than the least loaded
# How many health intervals a follower keeps an engine at a version the store has not recorded.
UNRECORDED_GRACE_ROUNDS = 1.5
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def parse_version(version: str) -> int:
    """proxrl versions are integers; SGLang's start-up "default" is version 0."""
    match = _TRAILING_NUMBER.search(version)
    return int(match.group(1)) if match else 0


UNKNOWN_CONTEXT = (
    "its context length is unknown (no context_length in /server_info, no max_model_len in "
    "/v1/models, none in /model_info); start it with --context-length N"
)


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def reported_context(server_info: dict, models: dict | None, model_info: dict) -> int | None:
    """The context length an engine reports, or None: ``/server_info`` ``context_length``
    (SGLang: only when set at launch; its Rust frontend says ``max_context_length``), then
    ``/v1/models`` ``data[0].max_model_len`` (SGLang's effective length), then ``/model_info``."""
    cards = (models or {}).get("data") or [{}]
    candidates = [
        server_info.get("context_length"),
        server_info.get("max_context_length"),
        cards[0].get("max_model_len") if isinstance(cards[0], dict) else None,
        model_info.get("context_length"),
        model_info.get("max_model_len"),
    ]
    return next((n for n in map(_positive_int, candidates) if n is not None), None)


@dataclass(eq=False)
class EngineState:
    client: EngineClient
    healthy: bool = False
    in_flight: int = 0
    incremental_streaming: bool = False
    context_length: int | None = None  # None until the engine reports it: out of rotation
    tp_size: int = 1  # its tensor-parallel ranks (a weight group gives it this many)
    refused: str | None = None  # why proxrl cannot use it whatever it answers, once learned
    weight_version: str | None = None
    # Out of rotation only because it serves another version than the run's (a load that was
    # given up on and finished later): the next publish loads it with the others.
    off_version: bool = False
    # Why it serves that other version, where proxrl learned it (a reset to the base model that
    # failed, ``server.startup.reset_to_base``): (the version, why), told while it serves it.
    off_version_cause: tuple[str, str] | None = None
    # A swap's pause not answered in time, still on its way: the engine may apply it after the
    # swap's resume, and then hold its requests for good; once it has ended, the leader
    # resumes the engine again, fenced (``server.rl.weights.heal_pauses``).
    late_pause: asyncio.Future | None = None
    # A follower's: a newer version than the store's it found, and when (judged a round later).
    unrecorded: tuple[str, float] | None = None
    served_tokens: int = 0
    failures: int = 0
    last_error: str | None = None
    tokens_per_second: float = 0.0  # sampled through this proxy, between health checks
    _rate_mark: tuple[float, int] | None = None

    @property
    def url(self) -> str:
        return self.client.url

    def note_rate(self, now: float) -> None:
        """Update ``tokens_per_second`` from the tokens served since the last mark."""
        if self._rate_mark is not None:
            then, served = self._rate_mark
            if now - then < 1.0:
                return
            self.tokens_per_second = (self.served_tokens - served) / (now - then)
        self._rate_mark = (now, self.served_tokens)


ENGINE_KEEPALIVE_S = 3.0  # below every engine's keep-alive (uvicorn's default: 5 s)


class EnginePool:
    def __init__(
        self,
        urls: list[str],
        generate_timeout: float = 600.0,
        health_interval: float = 2.0,
    ) -> None:
        self._http = aiohttp.ClientSession(
            # Idle connections are dropped before an engine's server closes them (uvicorn's
            # default, which SGLang keeps, is 5 s), so a request never goes out on a connection
            # the engine is closing.
            connector=aiohttp.TCPConnector(
                limit=2048, limit_per_host=1024, keepalive_timeout=ENGINE_KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(total=30.0, connect=5.0),
        )
        self.engines = [
            EngineState(EngineClient(url, self._http, generate_timeout)) for url in urls
        ]
        self._health_interval = health_interval
        self._health_task: asyncio.Task | None = None
        self._stopping = False
        self._round_robin = itertools.count()
        self.update_lock = asyncio.Lock()  # one weight swap at a time
        self.swaps: list[dict] = []  # run_id, version, pause_seconds, at: one per swap
        # (run_id, version) of the last swap this replica made since it took the lead (None:
        # none, or one whose outcome is not known): what a retried swap is checked against
        self.last_swap: tuple[str, int] | None = None
        # The version every engine must serve to be in rotation (None: any); a follower's is
        # the least it may serve.
        self.expected_version: int | None = None
        self.leading = True  # False: a follower of the replica that drives the engines
        # A follower's source of the expected version (the store's), read each health round.
        self.read_version: Callable[[], Awaitable[int | None]] | None = None
        # A follower's: whether some run in the store records a version (an engine at a version
        # no run records is off-version).
        self.recorded: Callable[[int], Awaitable[bool]] | None = None
        # Work started for the engines outside a request (a takeover's resume), stopped with
        # the pool.
        self.background: set[asyncio.Task] = set()

    def in_background(self, work: Awaitable[None]) -> None:
        """Run ``work`` until it ends or the pool stops; an error it raises is logged."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("the engines' background work failed", exc_info=task.exception())

    async def start(self) -> None:
        await asyncio.gather(*(self.check(engine) for engine in self.engines))
        self._health_task = asyncio.create_task(self._health_loop(), name="proxrl-health")

    async def stop(self) -> None:
        """The health checks stopped, then the engines' connections closed. A check that
        swallowed its cancellation (a store driver that turned it into an error, which `follow`
        logs and goes on from: seen once, a server that never finished stopping) is cancelled
        again until it ends, and the loop ends at its next round anyway."""
        self._stopping = True
        for work in list(self.background):
            work.cancel()
        if self.background:
            await asyncio.wait(self.background, timeout=5.0)
        task = self._health_task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        await self._http.close()

    @property
    def healthy(self) -> list[EngineState]:
        return [engine for engine in self.engines if engine.healthy]

    @property
    def loadable(self) -> list[EngineState]:
        """The engines a publish loads: those in rotation, and those out of it only because
        they serve another version (without them, a fleet whose abandoned load finished late
        would have no engine to publish to, and no way back)."""
        return [engine for engine in self.engines if engine.healthy or engine.off_version]

    @property
    def context_length(self) -> int | None:
        lengths = [e.context_length for e in self.engines if e.context_length]
        return min(lengths) if lengths else None

    def pick(self, prefer: str | None = None, avoid: set[str] | None = None) -> EngineState:
        """The engine for the next request (``prefer``: the session's last engine)."""
        candidates = [e for e in self.healthy if not avoid or e.url not in avoid]
        if not candidates:
            candidates = self.healthy  # every engine was tried: try the healthy ones again
        if not candidates:
            raise NoEngineAvailable("no healthy engine is available")
        least = min(e.in_flight for e in candidates)
        for engine in candidates:
            if engine.url == prefer and engine.in_flight <= least + AFFINITY_SLACK:
                return engine
        idle = [e for e in candidates if e.in_flight == least]
        return idle[next(self._round_robin) % len(idle)]

    async def wait_for_engine(self, timeout: float) -> bool:
        """Probe the engines until one is healthy (one that failed a check by chance, say), for
        at most ``timeout`` seconds: a probe still waiting for an answer then is cut off."""
        try:
            async with asyncio.timeout(timeout):
                while not self.healthy:
                    await asyncio.gather(*(self.check(engine) for engine in self.engines))
                    if not self.healthy:
                        await asyncio.sleep(0.5)
        except TimeoutError:
            return False
        return True

    def mark_down(self, engine: EngineState, reason: str, failure: bool = True) -> None:
        """Out of rotation with ``reason``; ``failure``: it failed (counted), rather than being
        an engine proxrl cannot use as it is (unknown context, unsupported parallelism)."""
        if engine.healthy or reason != engine.last_error:
            log.warning("engine %s out of rotation: %s", engine.url, reason)
        engine.healthy = False
        engine.off_version = False
        engine.failures += failure
        engine.last_error = reason

    async def check(self, engine: EngineState) -> bool:
        """Probe one engine (``/model_info``: cheap, and answered even while paused)."""
        engine.note_rate(time.monotonic())
        expected, swapping = self.expected_version, self.update_lock.locked()
        try:
            info = await engine.client.model_info()
            if engine.context_length is None:
                await self._learn(engine, info)
        except (EngineError, ValueError) as exc:
            self.mark_down(engine, str(exc))
            return False
        except Exception as exc:  # an answer of an unexpected shape must not end the health loop
            self.mark_down(engine, f"unexpected answer: {type(exc).__name__}: {exc}")
            return False
        if engine.refused is not None:
            self.mark_down(engine, engine.refused, failure=False)
            return False
        if engine.context_length is None:
            self.mark_down(engine, UNKNOWN_CONTEXT, failure=False)
            return False
        if swapping or self.update_lock.locked() or self.expected_version != expected:
            # a weight swap overlapped the probe: the version it read may be from either side
            # of the swap, so it says nothing; the swap judges the engines it loaded
            return engine.healthy
        engine.weight_version = str(info.get("weight_version"))
        if not await self._on_version(engine, expected):
            return engine.healthy
        if not engine.healthy:
            log.info("engine %s in rotation (version %s)", engine.url, engine.weight_version)
        engine.healthy = True
        return True

    async def _learn(self, engine: EngineState, model_info: dict) -> None:
        """What the proxy needs to know of an engine once: its context length, tensor-parallel
        size and streaming mode (``/server_info``, and ``/v1/models`` when that has no
        context)."""
        server = await engine.client.server_info()
        engine.tp_size = _positive_int(server.get("tp_size")) or 1
        dp, pp = (_positive_int(server.get(key)) or 1 for key in ("dp_size", "pp_size"))
        if dp > 1 or pp > 1:
            engine.refused = (
                f"it runs dp_size={dp}, pp_size={pp}; proxrl's weight group takes one data- and "
                "pipeline-parallel rank per engine (start one engine per replica instead)"
            )
        incremental = server.get("incremental_streaming_output", server.get("stream_output"))
        engine.incremental_streaming = bool(incremental)
        models = None
        if reported_context(server, None, {}) is None:
            try:
                models = await engine.client.models()
            except EngineRejected:  # no /v1/models: an older or other engine
                models = None
        engine.context_length = reported_context(server, models, model_info)

    async def _on_version(self, engine: EngineState, expected: int | None) -> bool:
        """Whether ``engine`` serves the expected version (a follower's: or one another run
        records, ``recorded``); if not, it is out of rotation, or (a follower's,
        ``_recording``) kept as it is for now."""
        version = engine.weight_version or ""
        if expected is None or parse_version(version) == expected or await self._recorded(version):
            engine.unrecorded = None
            return True
        if not self._recording(engine, version, expected):
            self.mark_off_version(engine, version, expected)
        return False

    def mark_off_version(self, engine: EngineState, version: str, expected: int) -> None:
        """Out of rotation because it serves ``version``, not ``expected`` (with the cause, where
        known): the next publish loads it with the others."""
        reason = f"serves version {version}, not {expected}"
        cause = engine.off_version_cause
        self.mark_down(
            engine, reason if cause is None or cause[0] != version else f"{reason}: {cause[1]}"
        )
        engine.off_version = True

    async def _recorded(self, version: str) -> bool:
        """A follower's: whether the store records ``version`` as some run's (the one the
        leader swapped last need not be the default run); the store away: judged as before."""
        if self.leading or self.recorded is None:
            return False
        try:
            async with asyncio.timeout(max(self._health_interval, 1.0)):
                return await self.recorded(parse_version(version))
        except Exception as exc:
            log.warning("could not read the runs' versions from the store: %s", exc)
            return False

    def _recording(self, engine: EngineState, version: str, expected: int) -> bool:
        """Whether a follower keeps, for now, an engine found serving a newer version than the
        store's (the leader's record of it may be on its way): for ``UNRECORDED_GRACE_ROUNDS``
        health intervals from when it was first seen."""
        if self.leading or parse_version(version) < expected:
            return False
        now = time.monotonic()
        if engine.unrecorded is None or engine.unrecorded[0] != version:
            engine.unrecorded = (version, now)
        return now - engine.unrecorded[1] < UNRECORDED_GRACE_ROUNDS * self._health_interval

    async def follow(self) -> None:
        """The expected version from the store (kept as it was when the store does not answer
        within a health interval): a follower takes it; the leader only a newer one, which a
        leader before it recorded after this one took over (it lost the lead mid-swap, and
        finished)."""
        if self.read_version is None or (self.leading and self.update_lock.locked()):
            return
        try:
            async with asyncio.timeout(max(self._health_interval, 1.0)):
                version = await self.read_version()
        except Exception as exc:  # the store away: judge by the last version read
            log.warning("could not read the run's version from the store: %s", exc)
            return
        if version is None:
            return
        if not self.leading:
            self.expected_version = version
        elif self.expected_version is None or version > self.expected_version:
            log.warning("the store records version %s, newer than this leader's: taken", version)
            self.expected_version = version

    async def _health_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._health_interval)
            await self.follow()
            await asyncio.gather(*(self.check(engine) for engine in self.engines))
