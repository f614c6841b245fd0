"""The door every request with a body passes before a route reads it, in this order:

1. **Who is calling** (401): on routes that need a key (``/v1/...``, ``/rl/...``,
   ``/admin/weights...``), no key or a key proxrl did not issue is refused before a byte of the
   body is read; on ``/sessions/{id}/v1/...`` the id must name a session (404). Scope (403) is
   the route's business, once it knows what is asked.
2. **How big** (413): a declared ``Content-Length`` over the route's limit is refused unread; a
   body without one (chunked) is counted as it arrives and refused once past the limit. The
   model routes (OpenAI, Anthropic) take ``max_body_bytes``, the rest ``max_rest_body_bytes``.
3. **How much** (413): a JSON body of more than ``max_json_containers`` arrays and objects
   (parsing and validating them would hold the event loop for seconds), except on the admin's
   ``/admin/weights...`` (a distributed publish lists every tensor).
4. **What every reader can serve back** (400): a JSON body not in UTF-8 (UTF-16 and UTF-32
   read as JSON too, and hide what the scans look for), or with a string UTF-8 cannot encode
   (a lone surrogate, from an escape like ``"\\ud800"`` or from a surrogate's own bytes), a
   number JSON cannot hold (NaN, Infinity, 1e999), or nesting deeper than ``max_json_depth``
   is refused, on every route, before the route parses it.

Bodies past 256 KiB are checked on a worker thread, by scans that each hold the interpreter for
milliseconds (a megabyte, or one string, at a time), so the event loop goes on meanwhile.

Refusals are in the surface's error shape (``server.errors``). It knows surfaces by path, keys
only through ``server.auth``, and nothing of the routes' schemas or of what they store.
"""

from __future__ import annotations

import json
import math
import re

import anyio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import auth, deps, errors
from server.errors import (
    AuthenticationRequired,
    BodyTooLarge,
    InvalidRequest,
    ProxrlError,
    ResourceNotFound,
    SessionNotFound,
)
from server.settings import ServerSettings
from server.store import stored_json

KEYED = ("/v1/", "/rl/", "/admin/weights")
_PATH_SESSION = re.compile(r"^/sessions/([^/]+)/v1/")
_MODEL_ROUTES = ("/v1/", "/sessions/")

# A string, or one never closed: it then runs to the end, so a scan never restarts inside it
# (restarting at each quote of an unclosed string took 19 s for 80 KB).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)', re.S)
_NOT_FINITE = re.compile(rb"NaN|Infinity")
# A trainer's step metrics may be NaN or Infinity (a loss that diverged): that route stores them
# as null, so only there are they let through.
_STEPS = re.compile(r"^/rl/runs/[^/]+/steps$")
# A distributed publish names every tensor of the model (a large MoE: far past
# max_json_containers); the admin's own call, not counted.
_WEIGHTS = "/admin/weights"
_BIG_EXPONENT = re.compile(rb"[0-9][eE]\+?[0-9]{3}")  # 1e309 and past read as Infinity
# A surrogate's UTF-8-like bytes (ED A0..BF xx), which JSON readers decode with surrogatepass.
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
# An escaped backslash (skipped), a surrogate pair, or half of one: 6 bytes long when alone.
_ESCAPE = re.compile(
    rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}(?:\\u[dD][c-fC-F][0-9a-fA-F]{2})?"
    rb"|\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
_SCAN_STEP = 1 << 20
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


class RequestLimits:
    """ASGI middleware: the checks above, then the route reads the body as it came."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "\x00" in scope["path"]:  # no route has one, and no text column could look it up
            exc = ResourceNotFound("No such path: it holds a NUL character (%00).")
            await errors.render(Request(scope), exc)(scope, receive, send)
            return
        if not _has_body(scope):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            await _authenticate(request)
            body = await self._read(request, receive)
            if body is None:  # the client left while sending
                return
            if body and deps.is_json(request):
                path = request.url.path
                await self._check(body, not _STEPS.match(path), not path.startswith(_WEIGHTS))
        except ProxrlError as exc:
            await errors.render(request, exc)(scope, receive, send)
            return
        await self.app(scope, _replaying(body, receive), send)

    def limit(self, path: str) -> int:
        if path.startswith(_MODEL_ROUTES):
            return self.settings.max_body_bytes
        return self.settings.max_rest_body_bytes

    async def _read(self, request: Request, receive: Receive) -> bytes | None:
        limit = self.limit(request.url.path)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(_too_large(int(declared), limit))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(_too_large(size, limit, more=True))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _check(self, body: bytes, finite: bool, counted: bool) -> None:
        if len(body) > deps.OFF_LOOP_BYTES:
            refusal = await anyio.to_thread.run_sync(self._refusal, body, finite, counted)
        else:
            refusal = self._refusal(body, finite, counted)
        if refusal is not None:
            raise refusal

    def _refusal(self, body: bytes, finite: bool, counted: bool) -> ProxrlError | None:
        if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
            # JSON readers take UTF-16 and UTF-32 too, where the scans below see no escape.
            return InvalidRequest(
                "The request body is JSON in UTF-16 or UTF-32; send it as UTF-8 (RFC 8259).",
                code="unservable_json",
            )
        most = self.settings.max_json_containers
        count = _containers(body, most) if counted else None
        if count is not None:
            return BodyTooLarge(
                f"The request body holds {count:,} arrays and objects; this server takes at "
                f"most {most:,} (max_json_containers)."
            )
        problem = json_problem(body, self.settings.max_json_depth, finite)
        if problem is None:
            return None
        return InvalidRequest(f"The request body holds {problem}.", code="unservable_json")


def _containers(body: bytes, most: int) -> int | None:
    """How many arrays and objects ``body`` holds outside its strings, when more than
    ``most`` (None when not). Parsing and validating a million small objects holds the event
    loop for seconds, in single calls no thread can share; the bracket count is cheap, and
    brackets inside strings (code) are taken out only when it is over."""
    if body.count(b"[") + body.count(b"{") <= most:
        return None
    bare = _outside_strings(body)
    count = bare.count(b"[") + bare.count(b"{")
    return count if count > most else None


def json_problem(body: bytes, max_depth: int, finite: bool = True) -> str | None:
    """What in a JSON ``body`` no reader could serve back (None: nothing, or not JSON at all,
    which the route answers). Scans of the bytes, each a short C call or a match at a time, so
    that a thread running them (bodies past ``deps.OFF_LOOP_BYTES``) leaves the event loop
    free; the body is parsed only to say where a lone surrogate is."""
    if _nesting_exceeds(body, max_depth):
        return f"nesting deeper than {max_depth} levels (max_json_depth)"
    if finite and _not_finite(body):
        return "a number JSON cannot hold (NaN, Infinity, or past a double's range)"
    lone = "a string UTF-8 cannot encode (a lone surrogate)"
    # A surrogate's own bytes are not UTF-8, but JSON readers take them (surrogatepass).
    if _search(_RAW_SURROGATE, body, 2) is not None:
        return lone
    if (b"\\ud" not in body and b"\\uD" not in body) or not _lone_escape(body):
        return None  # every escaped surrogate is half of a pair
    try:  # where it is, for the answer
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return stored_json.problem(value, max_depth) or lone


def _search(pattern: re.Pattern[bytes], body: bytes, reach: int) -> re.Match[bytes] | None:
    """``pattern.search(body)`` a megabyte at a time (a match is at most ``reach`` bytes)."""
    for start in range(0, len(body), _SCAN_STEP):
        found = pattern.search(body, start, start + _SCAN_STEP + reach)
        if found is not None:
            return found
    return None


def _outside_strings(body: bytes) -> bytes:
    """``body`` without its strings: one substitution for a small body, else a string at a
    time (one ``sub`` over a million strings holds the interpreter for a second)."""
    if len(body) <= deps.OFF_LOOP_BYTES:
        return _STRING.sub(b"", body)
    pieces, at = [], 0
    for match in _STRING.finditer(body):
        pieces.append(body[at : match.start()])
        at = match.end()
    pieces.append(body[at:])
    return b"".join(pieces)


def _not_finite(body: bytes) -> bool:
    """Whether a number outside the strings of ``body`` is NaN, Infinity or too big for a
    double (1e309 reads as Infinity)."""
    named = b"NaN" in body or b"Infinity" in body
    if not named and _search(_BIG_EXPONENT, body, 6) is None:
        return False
    bare = _outside_strings(body)
    return _NOT_FINITE.search(bare) is not None or (
        _BIG_EXPONENT.search(bare) is not None and _overflows(body)
    )


def _lone_escape(body: bytes) -> bool:
    """Whether ``body`` escapes half a surrogate pair alone (``"\\ud800"``): escapes read in
    order, an escaped backslash taken whole so that ``"\\\\ud800"`` is text."""
    return any(len(match.group()) == 6 for match in _ESCAPE.finditer(body))


def _overflows(body: bytes) -> bool:
    """Whether a number in the JSON ``body`` reads as Infinity (a body that is not JSON: no)."""
    found = False

    def number(text: str) -> float:
        nonlocal found
        value = float(text)
        found = found or math.isinf(value)
        return value

    try:
        json.loads(body, parse_float=number)
    except (ValueError, RecursionError):
        return False
    return found


def _nesting_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether the JSON ``body`` nests deeper than ``max_depth``: its brackets outside strings,
    innermost pairs removed once per level (each pass is one C-speed scan)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    brackets = _outside_strings(body).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = _INNERMOST.sub(b"", brackets)
    return bool(brackets)


async def _authenticate(request: Request) -> None:
    path = request.url.path
    ctx = request.app.state.ctx
    token = auth.presented_key(
        request.headers.get("authorization"), request.headers.get("x-api-key")
    )
    path_session = _PATH_SESSION.match(path)
    if path_session is not None:
        # The id in the path is the credential: a key proxrl did not issue counts as none.
        if await ctx.sessions.get(path_session.group(1)) is None:
            raise SessionNotFound(path_session.group(1))
        return
    if not path.startswith(KEYED):
        return
    if not token:
        raise AuthenticationRequired(
            "This call needs a key: 'Authorization: Bearer <key>' (or x-api-key).",
            code="invalid_api_key" if path.startswith("/v1/") else None,
        )
    await auth.identify_key(ctx, token)  # InvalidKey (401) for a key proxrl did not issue


def _has_body(scope: Scope) -> bool:
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return b"transfer-encoding" in headers


def _too_large(size: int, limit: int, more: bool = False) -> str:
    return (
        f"The request body is {'over ' if more else ''}{size:,} bytes; this route takes at most "
        f"{limit:,} (max_body_bytes on the model routes, max_rest_body_bytes on the others)."
    )


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the body already read, then whatever the client sends next (its
    disconnect, which a stream watches for)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
