"""The asynchronous client and its sessions: ``Client``'s mirror twin (see ``_client``), the
same methods awaited. The one difference: ``AsyncClient.session()`` returns the session
before it exists on the server; ``await`` it or enter it with ``async with`` to create it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from types import TracebackType
from typing import Any, cast

import httpx

from client_sdk._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    SessionBase,
    connection_error,
    log_retry,
    metrics_of,
    resolve_config,
    retry_delay,
    reward_body,
    run_body,
    segment,
    session_body,
)
from client_sdk._errors import ProxrlError, error_from_response
from client_sdk._types import (
    RewardResult,
    Run,
    RunCreated,
    RunMetrics,
    SessionCreated,
    SessionDetail,
    SessionEnded,
)


class AsyncClient:
    """proxrl's REST API, asynchronously; arguments, environment and retries as ``Client``."""

    def __init__(
        self,
        base_url: str | None = None,
        admin_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self._config = resolve_config(base_url, admin_key, timeout, max_retries)
        self._http = httpx.AsyncClient(**self._config.http_options())

    @property
    def base_url(self) -> str:
        return self._config.base_url

    @property
    def timeout(self) -> httpx.Timeout:
        return self._config.timeout

    @property
    def max_retries(self) -> int:
        return self._config.max_retries

    # ---------------------------------------------------------------------------------------
    # runs

    async def create_run(
        self, name: str = "run", config: dict[str, Any] | None = None
    ) -> RunCreated:
        """A new run; its ``api_key`` is in this answer only (see ``Client.create_run``)."""
        body = run_body(name, config)
        return cast(RunCreated, await self._request("POST", "/rl/runs", json=body))

    async def list_runs(self, *, limit: int = 100, offset: int = 0) -> list[Run]:
        params = {"limit": limit, "offset": offset}
        return cast(list[Run], await self._request("GET", "/rl/runs", params=params))

    async def get_run(self, run_id: str) -> Run:
        return cast(Run, await self._request("GET", f"/rl/runs/{segment(run_id)}"))

    async def update_run_config(self, run_id: str, config: dict[str, Any]) -> Run:
        """Merge ``config`` into the run's config (a key set to None resets it to None)."""
        path = f"/rl/runs/{segment(run_id)}"
        return cast(Run, await self._request("PATCH", path, json={"config": config}))

    async def run_metrics(self, run_id: str) -> RunMetrics:
        """The run's counters. The server has no separate metrics route: these are the
        session counts by status, the turn and token totals, and the policy version that
        GET /rl/runs/{id} reports."""
        return metrics_of(await self.get_run(run_id))

    # ---------------------------------------------------------------------------------------
    # sessions

    def session(
        self,
        run_id: str | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        eval: bool = False,
        production: bool = False,
    ) -> AsyncSession:
        """A session to create: ``async with client.session(...) as s`` (ended on exit) or
        ``s = await client.session(...)``. Admission, ``eval`` and ``production`` as in
        ``Client.session``."""
        body = session_body(run_id, task_id, group_id, metadata, eval, production)
        return AsyncSession(self, body)

    async def get_session(self, session_id: str) -> SessionDetail:
        """The stored session: status, rewards, every turn's tokens, and its training rows."""
        path = f"/rl/sessions/{segment(session_id)}"
        return cast(SessionDetail, await self._request("GET", path))

    async def reward(
        self, session_id: str, value: float, completion_id: str | None = None
    ) -> RewardResult:
        """Reward a session (or one turn), also after it ended; see ``Client.reward``."""
        path = f"/rl/sessions/{segment(session_id)}/reward"
        body = reward_body(value, completion_id)
        return cast(RewardResult, await self._request("POST", path, json=body))

    async def end_session(self, session_id: str) -> SessionEnded:
        """End a session; ending one that already ended is a no-op."""
        path = f"/rl/sessions/{segment(session_id)}/end"
        return cast(SessionEnded, await self._request("POST", path))

    async def _create_session(self, body: dict[str, Any]) -> SessionCreated:
        return cast(SessionCreated, await self._request("POST", "/rl/sessions", json=body))

    # ---------------------------------------------------------------------------------------
    # transport

    async def _request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        retries_taken = 0
        while True:
            error: ProxrlError
            try:
                response = await self._http.request(method, path, json=json, params=params)
            except httpx.TransportError as exc:
                error = connection_error(exc)
                error.__cause__ = exc
            else:
                if response.is_success:
                    return response.json()
                error = error_from_response(response)
            delay = retry_delay(retries_taken, self.max_retries, error)
            if delay is None:
                raise error
            retries_taken += 1
            log_retry(method, path, error, delay, retries_taken, self.max_retries)
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncClient {self.base_url}>"


class AsyncSession(SessionBase):
    """One agent episode of an ``AsyncClient``: created when awaited or entered; as an async
    context manager it ends the session on exit, also when the block raises (then an error
    while ending is not allowed to hide the block's own)."""

    def __init__(self, client: AsyncClient, body: dict[str, Any]) -> None:
        self._client = client
        self._body = body
        self._created = None
        self._starting = asyncio.Lock()  # two tasks awaiting it create one session

    async def start(self) -> AsyncSession:
        """Create the session on the server (once; later calls return it as it is)."""
        async with self._starting:
            if self._created is None:
                self._created = await self._client._create_session(self._body)
        return self

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self.start().__await__()

    async def reward(self, value: float, completion_id: str | None = None) -> RewardResult:
        return await self._client.reward(self.id, value, completion_id)

    async def end(self) -> SessionEnded:
        """End it (again: a no-op)."""
        return await self._client.end_session(self.id)

    async def get(self) -> SessionDetail:
        return await self._client.get_session(self.id)

    async def __aenter__(self) -> AsyncSession:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.end()
        except ProxrlError:
            if exc is None:
                raise
