"""The synchronous client and its sessions (``AsyncClient`` in ``_async_client`` is the twin).

It speaks proxrl's REST API (/rl/runs, /rl/sessions) with the admin key (or a run key); the
agent's model calls go through a stock ``openai.OpenAI`` that ``Session.openai()`` points at
the session. It knows nothing of the server's code: only its JSON.
"""

from __future__ import annotations

import time
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


class Client:
    """proxrl's REST API, synchronously.

    ``base_url`` is the server's root (not its ``/v1``): the argument, else ``PROXRL_BASE_URL``,
    else ``http://127.0.0.1:8000``. ``admin_key``: the argument, else ``PROXRL_ADMIN_KEY``; a run
    key also works, within its run. ``timeout`` applies to every request (seconds or an
    ``httpx.Timeout``; keep it above the runs' ``admission_wait_s``). Connection errors,
    timeouts, 408, 429 and 5xx are retried up to ``max_retries`` times with exponential backoff
    and jitter, or after the server's Retry-After; then the error is raised (see ``_errors``).
    Every call is retried that way, creations included: a 429 means nothing was created.
    """

    def __init__(
        self,
        base_url: str | None = None,
        admin_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self._config = resolve_config(base_url, admin_key, timeout, max_retries)
        self._http = httpx.Client(**self._config.http_options())

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

    def create_run(self, name: str = "run", config: dict[str, Any] | None = None) -> RunCreated:
        """A new run; its ``api_key`` is in this answer only. ``config`` keys: batch_size,
        max_staleness, group_size, admission_wait_s, idle_timeout_s, reward_timeout_s,
        on_missing_reward, default_reward, claim_lease_s, and any of the trainer's own."""
        return cast(RunCreated, self._request("POST", "/rl/runs", json=run_body(name, config)))

    def list_runs(self, *, limit: int = 100, offset: int = 0) -> list[Run]:
        params = {"limit": limit, "offset": offset}
        return cast(list[Run], self._request("GET", "/rl/runs", params=params))

    def get_run(self, run_id: str) -> Run:
        return cast(Run, self._request("GET", f"/rl/runs/{segment(run_id)}"))

    def update_run_config(self, run_id: str, config: dict[str, Any]) -> Run:
        """Merge ``config`` into the run's config (a key set to None resets it to None)."""
        path = f"/rl/runs/{segment(run_id)}"
        return cast(Run, self._request("PATCH", path, json={"config": config}))

    def run_metrics(self, run_id: str) -> RunMetrics:
        """The run's counters. The server has no separate metrics route: these are the
        session counts by status, the turn and token totals, and the policy version that
        GET /rl/runs/{id} reports."""
        return metrics_of(self.get_run(run_id))

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
    ) -> Session:
        """Start a session now (in the server's default run unless ``run_id``); use it as a
        context manager to end it on exit. Sessions of one ``task_id``/``group_id`` form a
        GRPO group. At the run's staleness bound the server holds the call up to the run's
        ``admission_wait_s``, then answers 429, which is retried (``RateLimitError`` at last).
        ``eval=True``: an evaluation session, served and recorded but never trained, admitted
        at once; its rewards show by policy version in ``get_run(...)["eval"]``.
        ``production=True``: traffic the run serves (its promoted version, where its promotion
        gate has one) but never trains on, admitted at once; not with ``eval``.
        """
        body = session_body(run_id, task_id, group_id, metadata, eval, production)
        return Session(self, cast(SessionCreated, self._request("POST", "/rl/sessions", json=body)))

    def get_session(self, session_id: str) -> SessionDetail:
        """The stored session: status, rewards, every turn's tokens, and its training rows."""
        return cast(SessionDetail, self._request("GET", f"/rl/sessions/{segment(session_id)}"))

    def reward(
        self, session_id: str, value: float, completion_id: str | None = None
    ) -> RewardResult:
        """Reward a session (or one turn, by ``completion_id``), also after it ended. The same
        value again is a no-op (``created`` False); a different one is a ``ConflictError``."""
        path = f"/rl/sessions/{segment(session_id)}/reward"
        return cast(
            RewardResult, self._request("POST", path, json=reward_body(value, completion_id))
        )

    def end_session(self, session_id: str) -> SessionEnded:
        """End a session; ending one that already ended is a no-op."""
        path = f"/rl/sessions/{segment(session_id)}/end"
        return cast(SessionEnded, self._request("POST", path))

    # ---------------------------------------------------------------------------------------
    # transport

    def _request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        retries_taken = 0
        while True:
            error: ProxrlError
            try:
                response = self._http.request(method, path, json=json, params=params)
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
            time.sleep(delay)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self.base_url}>"


class Session(SessionBase):
    """One agent episode, created by ``Client.session()``. As a context manager it ends the
    session on exit, also when the block raises (then an error while ending is not allowed to
    hide the block's own). Rewards may still come after the end: ``Client.reward(id, ...)``.
    """

    def __init__(self, client: Client, created: SessionCreated) -> None:
        self._client = client
        self._created = created

    def reward(self, value: float, completion_id: str | None = None) -> RewardResult:
        return self._client.reward(self.id, value, completion_id)

    def end(self) -> SessionEnded:
        """End it (again: a no-op)."""
        return self._client.end_session(self.id)

    def get(self) -> SessionDetail:
        return self._client.get_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.end()
        except ProxrlError:
            if exc is None:
                raise
