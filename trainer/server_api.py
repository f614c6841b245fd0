"""The trainer's calls to ``proxrl serve``: run config, claims, publishing weights, engines.

Plain REST with the admin key, a timeout on every call, and retries on connection errors and
5xx for the calls that are safe to repeat. This module knows the server's routes and nothing
about training.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


class VersionSuperseded(ServerError):
    """A publish refused because the run has passed its version (a rollback took it)."""


class ServerAPI:
    def __init__(self, url: str, admin_key: str, timeout_s: float, retries: int = 5) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self._admin_key, self._timeout_s = admin_key, timeout_s
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        )

    def clone(self, retries: int = 0) -> ServerAPI:
        """Another client of the same server, for another thread."""
        return ServerAPI(self.url, self._admin_key, self._timeout_s, retries)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, retry: bool = True, **kwargs: Any) -> Any:
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt + 1 == attempts:
                    raise ServerError(f"{method} {path}: {exc!r}") from exc
            else:
                if response.status_code < 500 or attempt + 1 == attempts:
                    return _result(method, path, response)
            time.sleep(min(30.0, 0.5 * 2**attempt))
            log.warning("%s %s failed; retrying (%d/%d)", method, path, attempt + 1, attempts)
        raise AssertionError("unreachable")

    # ----- runs -------------------------------------------------------------------------------

    def default_run(self) -> dict:
        for run in self._call("GET", "/rl/runs", params={"limit": 1000}):
            if run.get("is_default"):
                return run
        raise ServerError("the server has no default run; name one with run_id=")

    def run(self, run_id: str) -> dict:
        return self._call("GET", f"/rl/runs/{run_id}")

    def rollbacks(self, run_id: str) -> list[list[int]]:
        """[source, version] for each version of the run that serves an earlier one's weights
        again, oldest first (empty from a server without rollbacks)."""
        return [list(pair) for pair in self.run(run_id).get("rollbacks", [])]

    def version_path(self, run_id: str, version: int) -> str | None:
        """Where the server recorded the files of the run's ``version`` (None: none)."""
        for row in self._call("GET", f"/rl/runs/{run_id}/versions"):
            if row["version"] == version:
                return row["path"]
        return None

    def configure_run(self, run_id: str, config: dict[str, Any]) -> dict:
        return self._call("PATCH", f"/rl/runs/{run_id}", json={"config": config})

    def post_step(self, run_id: str, step: int, version: int, metrics: dict[str, Any]) -> None:
        """The step's figures, for the dashboard (best effort: the trainer goes on without)."""
        body = {"step": step, "version": version, "metrics": metrics}
        try:
            self._call("POST", f"/rl/runs/{run_id}/steps", retry=False, json=body)
        except ServerError as exc:
            log.warning("could not record step %d on the server: %s", step, exc)

    # ----- claims -----------------------------------------------------------------------------

    def claim(self, run_id: str, max_sessions: int, lease_s: float, group_size: int) -> dict:
        body = {"max_sessions": max_sessions, "lease_s": lease_s, "group_size": group_size}
        # Not retried: a claim that reached the server but whose answer was lost comes back
        # when its lease runs out.
        return self._call("POST", f"/rl/runs/{run_id}/claims", retry=False, json=body)

    def renew(self, claim_ids: list[str], lease_s: float) -> dict[str, int]:
        """Extend the leases of ``claim_ids``; how many sessions each claim still holds."""
        body = {"claim_ids": claim_ids, "lease_s": lease_s}
        held = self._call("POST", "/rl/claims/renew", json=body)["held"]
        return {claim_id: int(held.get(claim_id, 0)) for claim_id in claim_ids}

    def drop(self, claim_id: str, dropped: dict[str, str]) -> dict[str, Any]:
        """Drop sessions of a claim now, with their reasons (they stop counting against
        admission at once; a later confirm counts them as settled)."""
        return self._call("POST", f"/rl/claims/{claim_id}/drop", json={"dropped": dropped})

    def confirm(self, claim_id: str, dropped: dict[str, str] | None = None) -> dict[str, Any]:
        """Mark the claim's sessions consumed, or dropped with the given reasons (idempotent);
        ``settled`` counts the claim's sessions now consumed or dropped."""
        body = {"dropped": dropped or {}}
        return self._call("POST", f"/rl/claims/{claim_id}/confirm", json=body)

    def trained(self, claim_id: str, version: int) -> int:
        """Mark the claim's sessions trained by the step that published ``version``: they stop
        counting against admission before a checkpoint confirms them. How many it marked."""
        body = {"version": version}
        return int(self._call("POST", f"/rl/claims/{claim_id}/trained", json=body)["trained"])

    def release(self, claim_id: str) -> int:
        return int(self._call("POST", f"/rl/claims/{claim_id}/release")["released"])

    # ----- weights ----------------------------------------------------------------------------

    def publish(
        self, run_id: str, model_path: str, version: int, timeout_s: float, adapter: bool = False
    ) -> dict:
        """Serve the directory at ``model_path`` as ``version``: full weights, or with
        ``adapter`` a LoRA adapter (peft's layout) that the engines load beside the others."""
        source = "adapter_path" if adapter else "model_path"
        body = {"run_id": run_id, source: model_path, "version": version}
        return self._call("POST", "/admin/weights", json=body, timeout=timeout_s)

    def publish_distributed(
        self, run_id: str, version: int, metadata: dict, group_name: str, timeout_s: float
    ) -> dict:
        body = {
            "run_id": run_id,
            "version": version,
            "distributed": {"group_name": group_name, **metadata},
        }
        return self._call("POST", "/admin/weights", retry=False, json=body, timeout=timeout_s)

    def init_weight_group(
        self, master_address: str, master_port: int, group_name: str, backend: str
    ) -> dict:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "group_name": group_name,
            "backend": backend,
        }
        return self._call("POST", "/admin/weights/group", retry=False, json=body)

    def probe_weights(self, path: str, token: str) -> dict:
        """Whether the server and its engines read the probe file at ``path``."""
        return self._call("POST", "/admin/weights/probe", json={"path": path, "token": token})

    def engines(self) -> list[dict]:
        return self._call("GET", "/admin/engines")


def _result(method: str, path: str, response: httpx.Response) -> Any:
    if response.status_code >= 400:
        code = None
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            message = response.text[:500]
        kind = VersionSuperseded if code == "version_superseded" else ServerError
        raise kind(f"{method} {path}: HTTP {response.status_code}: {message}")
    return response.json()
