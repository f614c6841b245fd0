"""Which LoRA adapters each engine holds, as far as this proxy knows: a request served with an
adapter goes to an engine only once the engine has it (``ensure`` loads it there first, one load
per engine and name however many requests wait on it). An engine that lost its adapters (it
restarted) answers a request for one as not loaded; ``forget`` drops what was known of it, and
the next ``ensure`` loads again.

Adapters loaded for *pinned* versions (outside their run's kept window: a request's pin, a
production session's promoted version) are bounded per engine (``pinned_per_engine``): before
one more is loaded, the least recently used one that no request is running on (``running``) is
unloaded (an engine's unload waits for the requests running on it). This module knows nothing
about runs, versions or the store: an adapter is a name and a directory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterator

from server.engine_client.client import EngineClient
from server.errors import EngineError, EngineRejected

log = logging.getLogger(__name__)

# How SGLang (and the embedded engine) refuse a second load of a name: "Failed to load LoRA
# adapter <name> because it is already loaded" (docs/architecture/sglang-protocol.md).
ALREADY_LOADED = "because it is already loaded"
# How long making room for a pinned adapter waits for an engine to unload one.
UNLOAD_WAIT_S = 30.0


class AdapterLoads:
    def __init__(self, pinned_per_engine: int = 2) -> None:
        self.pinned_per_engine = pinned_per_engine
        self._held: dict[str, set[str]] = {}  # engine url -> adapter names it holds
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        # engine url -> the pinned adapters it holds, least recently used first
        self._pinned: dict[str, OrderedDict[str, None]] = {}
        self._room: dict[str, asyncio.Lock] = {}  # engine url -> one pinned load at a time
        self._running: Counter[tuple[str, str]] = Counter()  # (url, name) -> requests on it

    def holds(self, url: str, name: str) -> bool:
        return name in self._held.get(url, ())

    async def ensure(
        self, client: EngineClient, name: str, path: str, pinned: bool = False
    ) -> None:
        """The engine at ``client`` holds adapter ``name`` (loaded from ``path`` if it did not;
        a ``pinned`` one within the engine's bound of pinned adapters). A refused load raises
        the client's error, for the request that asked to be refused."""
        if pinned and name in self._pinned.get(client.url, ()):
            self._pinned[client.url].move_to_end(name)
        if self.holds(client.url, name):
            return
        key = (client.url, name)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(client, name, path, pinned))
            self._loading[key] = task
            task.add_done_callback(lambda done: self._settled(key, done))
        await asyncio.shield(task)  # one waiter cancelled leaves the load to the others

    @contextlib.contextmanager
    def running(self, url: str, name: str) -> Iterator[None]:
        """A request runs on adapter ``name`` at ``url`` meanwhile: it is not unloaded to make
        room for a pinned one."""
        self._running[(url, name)] += 1
        try:
            yield
        finally:
            self._running[(url, name)] -= 1
            if not self._running[(url, name)]:
                del self._running[(url, name)]

    def pinned(self, url: str) -> list[str]:
        """The pinned adapters the engine at ``url`` holds, least recently used first."""
        return list(self._pinned.get(url, ()))

    def _settled(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A load is over: the next ``ensure`` starts another if it failed. Its error is read
        here too (its waiters may all have given up on it), so it is not reported as lost."""
        self._loading.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _load(self, client: EngineClient, name: str, path: str, pinned: bool) -> None:
        if not pinned:
            return await self._load_now(client, name, path)
        async with self._room.setdefault(client.url, asyncio.Lock()):
            await self._make_room(client)
            await self._load_now(client, name, path)
            self._pinned.setdefault(client.url, OrderedDict())[name] = None

    async def _make_room(self, client: EngineClient) -> None:
        """Unload the engine's least recently used pinned adapters that no request runs on,
        until one more fits its bound (if every one is running, it goes over for a while)."""
        held = self._pinned.get(client.url, OrderedDict())
        while len(held) >= self.pinned_per_engine:
            idle = next((n for n in held if (client.url, n) not in self._running), None)
            if idle is None:
                return
            try:
                await self.unload(client, idle, UNLOAD_WAIT_S)
            except EngineError as exc:  # it costs memory there, not correctness
                log.warning("could not unload adapter %s from %s: %s", idle, client.url, exc)
                return

    async def _load_now(self, client: EngineClient, name: str, path: str) -> None:
        try:
            await client.load_lora_adapter(name, path)
        except EngineRejected as exc:
            # A name is loaded once (SGLang's rule): one this proxy did not know of (it
            # restarted; another replica loaded it) is there already, under the same name,
            # which is never given other weights.
            if ALREADY_LOADED not in str(exc):
                raise
        self._held.setdefault(client.url, set()).add(name)

    async def unload(self, client: EngineClient, name: str, wait_s: float) -> None:
        """Unload adapter ``name`` from the engine at ``client`` (it waits for the requests
        running on it, ``wait_s`` at most); one it no longer holds counts as unloaded."""
        with contextlib.suppress(EngineRejected):
            await client.unload_lora_adapter(name, wait_s)
        self.unloaded(client.url, name)

    def loaded(self, url: str, name: str) -> None:
        """Record that the engine at ``url`` holds ``name`` (a publish loaded it there)."""
        self._held.setdefault(url, set()).add(name)

    def unloaded(self, url: str, name: str) -> None:
        self._held.get(url, set()).discard(name)
        self._pinned.get(url, OrderedDict()).pop(name, None)

    def forget(self, url: str, name: str | None = None) -> None:
        """What was known of the engine at ``url`` (of its adapter ``name`` only, if given) no
        longer holds: it answered that it does not have it."""
        if name is None:
            self._held.pop(url, None)
            self._pinned.pop(url, None)
        else:
            self.unloaded(url, name)

    def names(self, url: str) -> set[str]:
        return set(self._held.get(url, ()))
