"""The engines behind the proxy: health, load, and which one serves the next request.

Routing: the least-loaded healthy engine (requests in flight through this proxy), except that a
session stays on the engine that served its last turn (prefix caches) while that engine is
healthy and not clearly busier than the rest. An engine that fails a request or a health check
leaves the rotation until a health check succeeds again. This module knows nothing about
sessions, chat or the store.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from dataclasses import dataclass

import aiohttp

from server.engines.client import EngineClient, EngineError

log = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # a session's engine may have this many more requests than the least loaded
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def parse_version(version: str) -> int:
    """proxrl versions are integers; SGLang's start-up "default" is version 0."""
    match = _TRAILING_NUMBER.search(version)
    return int(match.group(1)) if match else 0


class NoEngineAvailable(Exception):
    pass


@dataclass(eq=False)
class EngineState:
    client: EngineClient
    healthy: bool = False
    in_flight: int = 0
    incremental_streaming: bool = False
    context_length: int | None = None
    weight_version: str | None = None
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


class EnginePool:
    def __init__(
        self,
        urls: list[str],
        generate_timeout: float = 600.0,
        health_interval: float = 2.0,
    ) -> None:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2048, limit_per_host=1024),
            timeout=aiohttp.ClientTimeout(total=30.0, connect=5.0),
        )
        self.engines = [
            EngineState(EngineClient(url, self._http, generate_timeout)) for url in urls
        ]
        self._health_interval = health_interval
        self._health_task: asyncio.Task | None = None
        self._round_robin = itertools.count()
        self.update_lock = asyncio.Lock()  # one weight swap at a time
        self.swaps: list[dict] = []  # run_id, version, pause_seconds, at: one per swap
        # The version every engine must serve to be in rotation (None: any).
        self.expected_version: int | None = None

    async def start(self) -> None:
        await asyncio.gather(*(self.check(engine) for engine in self.engines))
        self._health_task = asyncio.create_task(self._health_loop(), name="proxrl-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self._http.close()

    @property
    def healthy(self) -> list[EngineState]:
        return [engine for engine in self.engines if engine.healthy]

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
        """Probe the engines until one is healthy (an engine restarting, say), up to ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.healthy:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.gather(*(self.check(engine) for engine in self.engines))
            if not self.healthy:
                await asyncio.sleep(0.5)
        return True

    def mark_down(self, engine: EngineState, reason: str) -> None:
        if engine.healthy:
            log.warning("engine %s out of rotation: %s", engine.url, reason)
        engine.healthy = False
        engine.failures += 1
        engine.last_error = reason

    async def check(self, engine: EngineState) -> bool:
        """Probe one engine (``/model_info``: cheap, and answered even while paused)."""
        engine.note_rate(time.monotonic())
        try:
            info = await engine.client.model_info()
            if engine.context_length is None:
                server = await engine.client.server_info()
                engine.context_length = server.get("context_length")
                engine.incremental_streaming = bool(server.get("incremental_streaming_output"))
        except (EngineError, ValueError) as exc:
            self.mark_down(engine, str(exc))
            return False
        engine.weight_version = str(info.get("weight_version"))
        expected = self.expected_version
        if expected is not None and parse_version(engine.weight_version) != expected:
            self.mark_down(engine, f"serves version {engine.weight_version}, not {expected}")
            return False
        if not engine.healthy:
            log.info("engine %s in rotation (version %s)", engine.url, engine.weight_version)
        engine.healthy = True
        return True

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval)
            await asyncio.gather(*(self.check(engine) for engine in self.engines))
