"""Who is calling: the admin, a run (its key), or one session (its key, its path, or a run key
with ``X-Session-Id``). Keys are compared by their SHA-256 hashes, as they are stored.

A session key reaches only its own session; the path form ``/sessions/{id}/v1/...`` lets agents
whose key is fixed name their session, the unguessable session id acting as the credential.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Literal

from server.context import ServerContext
from server.errors import (
    AuthenticationRequired,
    InvalidKey,
    InvalidRequest,
    KeyOutOfScope,
    SessionNotFound,
)
from server.proxy.session_cache import SessionState
from server.store import runs as store_runs
from server.store import sessions as store_sessions
from server.store.keys import hash_key


@dataclass(frozen=True)
class Caller:
    kind: Literal["admin", "run", "session", "anonymous"]
    run_id: str | None = None
    session_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``x-api-key`` (as
    Anthropic's clients send it); None for neither. Every reader of keys asks this."""
    return bearer(authorization) or (x_api_key or "").strip() or None


async def identify(ctx: ServerContext, authorization: str | None) -> Caller:
    """The caller behind an Authorization header (anonymous without one; 401 if unknown)."""
    return await identify_key(ctx, bearer(authorization))


async def identify_key(ctx: ServerContext, token: str | None) -> Caller:
    """The caller behind a key (anonymous without one; 401 if unknown)."""
    if token is None:
        return Caller("anonymous")
    key_hash = hash_key(token)
    if hmac.compare_digest(key_hash, ctx.admin_key_hash):
        return Caller("admin")
    cached = ctx.key_cache.get(key_hash)
    if cached is None:
        # Keys are issued before anyone can use them, so one unknown now stays unknown.
        if ctx.unknown_keys.get(key_hash):
            raise InvalidKey()
        cached = await _lookup(ctx, key_hash)
        if cached is None:
            ctx.unknown_keys.put(key_hash, True)
            raise InvalidKey()
        ctx.key_cache.put(key_hash, cached)
    kind, run_id, session_id = cached
    return Caller(kind, run_id, session_id)  # type: ignore[arg-type]


async def _lookup(ctx: ServerContext, key_hash: str) -> tuple[str, str | None, str | None] | None:
    async with ctx.sessionmaker() as db:
        session = await store_sessions.session_by_key_hash(db, key_hash)
        if session is not None:
            return ("session", session.run_id, session.id)
        run = await store_runs.run_by_key_hash(db, key_hash)
        if run is not None:
            return ("run", run.id, None)
    return None


def require_admin(caller: Caller) -> None:
    if caller.kind == "anonymous":
        raise AuthenticationRequired(
            "This call needs the admin key: 'Authorization: Bearer <key>'."
        )
    if not caller.is_admin:
        raise KeyOutOfScope("This call needs the admin key.")


def require_run_access(caller: Caller, run_id: str) -> None:
    """The admin, or the run's own key."""
    if caller.is_admin or (caller.kind == "run" and caller.run_id == run_id):
        return
    if caller.kind == "anonymous":
        raise AuthenticationRequired("This call needs the admin key or the run's key.")
    raise KeyOutOfScope("This key cannot reach that run.")


def require_session_access(caller: Caller, run_id: str, session_id: str) -> None:
    """The admin, the run's key, or the session's own key."""
    if caller.kind == "session" and caller.session_id == session_id:
        return
    require_run_access(caller, run_id)


async def session_for_generation(
    ctx: ServerContext, caller: Caller, path_session: str | None, header_session: str | None
) -> SessionState:
    """The session an OpenAI-style call belongs to, checked against the caller."""
    if caller.kind == "session":
        if path_session is not None and path_session != caller.session_id:
            raise KeyOutOfScope("This session key belongs to another session.")
        session_id = caller.session_id
    elif path_session is not None:
        session_id = path_session
    else:
        if caller.kind == "anonymous":
            raise AuthenticationRequired(
                "Missing API key: use a session key from POST /rl/sessions as the api_key.",
                code="invalid_api_key",
            )
        session_id = header_session
        if session_id is None:
            raise InvalidRequest(
                "Name the session: use its key as api_key, the path /sessions/{id}/v1/..., or "
                "the header X-Session-Id."
            )
    assert session_id is not None
    state = await ctx.sessions.get(session_id)
    if state is None:
        raise SessionNotFound(session_id)
    if caller.kind == "run" and caller.run_id != state.run_id:
        raise KeyOutOfScope("This run key cannot reach that session.")
    return state
