"""Overload: what ``proxrl serve`` holds at once, and the fast 503 beyond it.

Two layers. ``guarded_protocol`` is uvicorn's HTTP protocol with three bounds per connection:

- **Connections**: at most ``connection_cap`` are held. A new one past the cap first closes
  the connections idle longest (keep-alive ones between requests, or ones that never sent a
  byte); where none is idle, its request is answered 503 with Retry-After (``SHED``), and past
  a small margin more it is closed at once, before the process runs out of file descriptors
  (then the kernel would hold new connections unanswered, and nothing would be logged).
- **Headers**: a request's head must arrive within ``header_timeout_s`` of its first byte (or
  of the connection, for its first request): a client sending a byte at a time is cut off.
- **Bodies**: a request's body must arrive within ``body_timeout_s`` of its head.

``InFlight`` is an ASGI middleware that bounds the requests in flight per caller class (admin,
run, session, anonymous: ``server.auth.Caller``), so that one class cannot take every
connection from the others; past its class's bound a request gets 503 with Retry-After in the
shape of the API it came in on (``errors.Overloaded``). Health probes are never refused.

It knows neither the routes nor the store, only the caller's class and uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server import auth, errors

log = logging.getLogger(__name__)

# Descriptors kept for everything but client connections: the store, logs, the tokenizer.
RESERVED_DESCRIPTORS = 64
# Past the cap, how many more connections are let in to be answered 503 (the rest are closed).
SHED_MARGIN = 32
# Set in a request's scope whose connection is past the cap: answered 503 before routing.
SHED = "proxrl.shed"
RETRY_AFTER_S = 1
HEALTH_PROBES = frozenset({"/health", "/"})
WARN_EVERY_S = 10.0


def connection_cap(wanted: int) -> int:
    """``wanted``, or less where the open-file limit (``ulimit -n``) could not hold it: each
    connection in use may hold one to an engine too, and a reserve stays for the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - RESERVED_DESCRIPTORS) // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    cap: int
    header_timeout_s: float
    body_timeout_s: float


class _Warnings:
    """One log line per kind of overload every ``WARN_EVERY_S``, with how many were shed."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def note(self, kind: str, message: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.last.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            log.warning("%s (%d since the last such line)", message, self.counts[kind])
            self.last[kind], self.counts[kind] = now, 0


WARNINGS = _Warnings()


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol held to ``limits`` (give it as ``uvicorn.run(http=...)``)."""

    class Guarded(GuardedProtocol):
        pass

    Guarded.limits = limits
    return Guarded


class GuardedProtocol(HttpToolsProtocol):
    limits: ConnectionLimits
    _timer: asyncio.TimerHandle | None = None
    _idle_since = 0.0
    _receiving = False  # a request's head or body is arriving
    _head_done = False
    _shed = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        self._arm(self.limits.header_timeout_s)
        self._make_room()

    def _make_room(self) -> None:
        """Past the cap: close the connections idle longest; none idle: shed this one."""
        cap = self.limits.cap
        live = [c for c in self.connections if not c.transport.is_closing()]
        excess = len(live) - cap
        if excess <= 0:
            return
        idle = sorted(
            (c for c in live if isinstance(c, GuardedProtocol) and c is not self and c.idle),
            key=lambda c: c._idle_since,
        )
        for connection in idle[:excess]:
            connection.transport.close()
        if idle:
            WARNINGS.note("evict", f"at the connection cap ({cap}): closed idle connections")
        if excess <= len(idle):
            return
        if excess > len(idle) + SHED_MARGIN:
            WARNINGS.note("close", f"past the connection cap ({cap}) and its margin: refused")
            self.transport.abort()
        else:
            self._shed = True

    @property
    def idle(self) -> bool:
        """Between requests (or before the first): nothing would be lost by closing it."""
        answered = self.cycle is None or self.cycle.response_complete
        return answered and not self._receiving and not self.pipeline

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._receiving and not self._head_done:
            # Mid-head: nothing runs for this request yet, so it may be told why.
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
        if self._receiving or self.cycle is None:
            WARNINGS.note("slow", "closed connections whose request did not arrive in time")
            self.transport.close()

    # ----- uvicorn's parser callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._receiving, self._head_done = True, False
        if self._timer is None:  # a later request on a kept-alive connection
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        if self._shed:
            self.scope.setdefault("extensions", {})[SHED] = {}
        self._head_done = True
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._receiving = False
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


# ----- requests in flight per caller class ---------------------------------------------------


class InFlight:
    """ASGI middleware: at most ``caps[kind]`` requests in flight per caller class, and at most
    ``per_session`` of any one session (by its key or the id in its path), so that one agent
    cannot take its class's whole bound from the others."""

    def __init__(self, app: ASGIApp, caps: Mapping[str, int], per_session: int) -> None:
        self.app = app
        self.caps = dict(caps)
        self.per_session = per_session
        self.in_flight = dict.fromkeys(self.caps, 0)
        self.sessions: dict[str, int] = {}  # a session's requests in flight (only while any)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PROBES:
            await self.app(scope, receive, send)
            return
        if SHED in scope.get("extensions", {}):
            detail = "The server holds as many connections as it can; retry shortly."
            await _refuse(scope, receive, send, detail, close=True)
            return
        kind, who = await caller(scope)
        if self.in_flight[kind] >= self.caps[kind]:
            WARNINGS.note(kind, f"{kind} requests at their bound ({self.caps[kind]}): refused")
            detail = f"{self.caps[kind]} {kind} requests are in flight, the most it takes."
            await _refuse(scope, receive, send, detail)
            return
        session = who if kind == "session" else None
        if session is not None and self.sessions.get(session, 0) >= self.per_session:
            WARNINGS.note("one session", f"a session at its bound ({self.per_session}): refused")
            detail = (
                f"{self.per_session} requests of this session are in flight, the most one "
                "session may have (--max-requests-per-session)."
            )
            await _refuse(scope, receive, send, detail)
            return
        self.in_flight[kind] += 1
        if session is not None:
            self.sessions[session] = self.sessions.get(session, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[kind] -= 1
            if session is not None:
                left = self.sessions.pop(session) - 1
                if left:
                    self.sessions[session] = left


async def caller(scope: Scope) -> tuple[str, str | None]:
    """The class of the request's caller, by its key (``Authorization: Bearer`` or
    ``x-api-key``) or its path (``/sessions/{id}/...``: the id is the credential), and for a
    session which one (its id). A key that is not one counts as none: the route refuses it,
    once admitted."""
    headers = dict(scope["headers"])
    token = auth.presented_key(
        headers.get(b"authorization", b"").decode("latin-1"),
        headers.get(b"x-api-key", b"").decode("latin-1"),
    )
    ctx = getattr(scope["app"].state, "ctx", None)
    if token is not None and ctx is not None:
        try:
            found = await auth.identify_key(ctx, token)
        except Exception:  # an unknown key, or a store that fails: the route says
            found = auth.Caller("anonymous")
        if found.kind != "anonymous":
            return found.kind, found.session_id
    path = scope["path"]
    if path.startswith("/sessions/"):
        return "session", path.split("/", 3)[2]
    return "anonymous", None


async def _refuse(
    scope: Scope, receive: Receive, send: Send, detail: str, close: bool = False
) -> None:
    response = errors.render(Request(scope), errors.Overloaded(detail))
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)
