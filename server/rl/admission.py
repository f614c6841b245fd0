"""Admission: how far generation may run ahead of training (AReaL's staleness bound).

A run admits a new session only while ``admitted < (max_staleness + version + 1) * batch_size``,
where ``admitted`` counts the run's sessions that may still be trained. Otherwise the caller
waits (up to the run's ``admission_wait_s``) for the trainer to publish a new version, then
gets a 429 with Retry-After. Runs without a ``batch_size`` admit everything. Evaluation sessions
are never trained: they neither count in ``admitted`` nor wait (``server.rl.sessions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable

from server.errors import StalenessBound
from server.store.run_config import RunConfig

RETRY_AFTER_S = 5


def admits(admitted: int, config: RunConfig, policy_version: int) -> bool:
    limit = config.admission_limit(policy_version)
    return limit is None or admitted < limit


class Admission:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._locks: dict[str, asyncio.Lock] = {}
        self.waits = 0
        self.refusals = 0

    def lock(self, run_id: str) -> asyncio.Lock:
        """Held while a session is checked and created, so two callers cannot both take the
        last place."""
        return self._locks.setdefault(run_id, asyncio.Lock())

    async def notify(self) -> None:
        """A version was published or sessions were dropped: waiters look again."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_room(
        self, check: Callable[[], Awaitable[tuple[bool, RunConfig]]], wait_s: float | None = None
    ) -> None:
        """Return once ``check`` admits; raise 429 after the run's admission_wait_s."""
        admitted, config = await check()
        if admitted:
            return
        self.waits += 1
        timeout = config.admission_wait_s if wait_s is None else wait_s
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                self.refusals += 1
                retry = max(1, math.ceil(min(RETRY_AFTER_S, timeout or RETRY_AFTER_S)))
                raise StalenessBound(retry)
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            admitted, config = await check()
            if admitted:
                return
