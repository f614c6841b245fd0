"""Which LoRA adapters each engine holds, as far as this proxy knows: a request served with an
adapter goes to an engine only once the engine has it (``ensure`` loads it there first, one load
per engine and name however many requests wait on it). An engine that lost its adapters (it
restarted) answers a request for one as not loaded; ``forget`` drops what was known of it, and
the next ``ensure`` loads again. This module knows nothing about runs, versions or the store:
an adapter is a name and a directory."""

from __future__ import annotations

import asyncio

from server.engine_client.client import EngineClient
from server.errors import EngineRejected

# How SGLang (and the embedded engine) refuse a second load of a name: "Failed to load LoRA
# adapter <name> because it is already loaded" (docs/architecture/sglang-protocol.md).
ALREADY_LOADED = "because it is already loaded"


class AdapterLoads:
    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}  # engine url -> adapter names it holds
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}

    def holds(self, url: str, name: str) -> bool:
        return name in self._held.get(url, ())

    async def ensure(self, client: EngineClient, name: str, path: str) -> None:
        """The engine at ``client`` holds adapter ``name`` (loaded from ``path`` if it did not).
        A refused load raises the client's error, for the request that asked to be refused."""
        if self.holds(client.url, name):
            return
        key = (client.url, name)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(client, name, path))
            self._loading[key] = task
            task.add_done_callback(lambda done: self._settled(key, done))
        await asyncio.shield(task)  # one waiter cancelled leaves the load to the others

    def _settled(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A load is over: the next ``ensure`` starts another if it failed. Its error is read
        here too (its waiters may all have given up on it), so it is not reported as lost."""
        self._loading.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _load(self, client: EngineClient, name: str, path: str) -> None:
        try:
            await client.load_lora_adapter(name, path)
        except EngineRejected as exc:
            # A name is loaded once (SGLang's rule): one this proxy did not know of (it
            # restarted; another replica loaded it) is there already, under the same name,
            # which is never given other weights.
            if ALREADY_LOADED not in str(exc):
                raise
        self._held.setdefault(client.url, set()).add(name)

    def loaded(self, url: str, name: str) -> None:
        """Record that the engine at ``url`` holds ``name`` (a publish loaded it there)."""
        self._held.setdefault(url, set()).add(name)

    def unloaded(self, url: str, name: str) -> None:
        self._held.get(url, set()).discard(name)

    def forget(self, url: str, name: str | None = None) -> None:
        """What was known of the engine at ``url`` (of its adapter ``name`` only, if given) no
        longer holds: it answered that it does not have it."""
        if name is None:
            self._held.pop(url, None)
        else:
            self.unloaded(url, name)

    def names(self, url: str) -> set[str]:
        return set(self._held.get(url, ()))
