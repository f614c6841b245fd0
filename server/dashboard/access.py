"""Who may see the dashboard: the admin, by bearer key or by the login cookie.

The login form takes the admin key and sets a cookie that says until when it is good and is
signed (HMAC-SHA256) under a random secret the server keeps in its store, over that expiry and
the admin key's hash. So the cookie holds nothing of the key, nobody computes one from the key
alone, it stops opening anything when it expires (``--dashboard-login-hours``), a restart on
the same store keeps browsers logged in, and changing the admin key logs every browser out. It
opens the dashboard's pages and read-only JSON and nothing else. It is HttpOnly,
SameSite=Strict (no other site can make the browser send it) and Secure when the request came
over https. Pages without the key redirect to the login form; JSON answers 401.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Annotated
from urllib.parse import quote

from fastapi import Cookie, Depends, Request
from fastapi.responses import RedirectResponse, Response

from server import auth
from server.context import ServerContext
from server.deps import CREDENTIAL_MAX_CHARS, Authorization, Ctx
from server.errors import AuthenticationRequired

COOKIE = "proxrl_admin"
COOKIE_PATH = "/admin"
COOKIE_VERSION = "v2"  # v1 (an HMAC of a fixed label under the key) is refused
LOGIN_PATH = "/admin/login"
MAX_COOKIE_LENGTH = 200  # ours are ~80 characters; longer ones are not read at all


class LoginRequired(Exception):
    """A dashboard page was asked for without the key: answered with a redirect to login."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def _signature(secret: bytes, admin_key_hash: str, expires_at: int) -> bytes:
    message = f"proxrl dashboard login|{admin_key_hash}|{expires_at}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


def issue_cookie(secret: bytes, admin_key_hash: str, expires_at: int) -> str:
    """A login cookie good until ``expires_at`` (Unix seconds) for the admin key whose SHA-256
    is ``admin_key_hash``, signed under the store's ``secret``."""
    signature = _signature(secret, admin_key_hash, expires_at).decode()
    return f"{COOKIE_VERSION}.{expires_at}.{signature}"


def cookie_valid(cookie: str, secret: bytes, admin_key_hash: str, now: float) -> bool:
    """Whether ``cookie`` was issued under ``secret`` for this admin key and has not expired at
    ``now`` (the signature compared in constant time)."""
    if len(cookie) > MAX_COOKIE_LENGTH:
        return False
    version, _, rest = cookie.partition(".")
    expiry, _, signature = rest.partition(".")
    if version != COOKIE_VERSION or not (expiry.isascii() and expiry.isdigit()):
        return False
    expires_at = int(expiry)
    if expires_at <= now:
        return False
    expected = _signature(secret, admin_key_hash, expires_at)
    return hmac.compare_digest(signature.encode("utf-8", "replace"), expected)


def key_matches(ctx: ServerContext, key: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(key.encode()).hexdigest(), ctx.admin_key_hash)


async def is_admin(ctx: ServerContext, authorization: str | None, cookie: str | None) -> bool:
    """A bearer admin key, or the login cookie (a bearer key that is not the admin's: 401/403
    as everywhere else)."""
    if authorization:
        caller = await auth.identify(ctx, authorization)
        auth.require_admin(caller)
        return True
    return cookie is not None and cookie_valid(
        cookie, ctx.dashboard_secret, ctx.admin_key_hash, time.time()
    )


async def require_api_admin(
    ctx: Ctx,
    authorization: Authorization = None,
    proxrl_admin: Annotated[str | None, Cookie(max_length=CREDENTIAL_MAX_CHARS)] = None,
) -> None:
    if not await is_admin(ctx, authorization, proxrl_admin):
        raise AuthenticationRequired(
            "The dashboard API needs the admin key: 'Authorization: Bearer <key>' or the "
            "dashboard's login cookie."
        )


async def require_page_admin(
    request: Request,
    ctx: Ctx,
    proxrl_admin: Annotated[str | None, Cookie(max_length=CREDENTIAL_MAX_CHARS)] = None,
) -> None:
    authorization = request.headers.get("authorization")
    if not await is_admin(ctx, authorization, proxrl_admin):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target)


ApiAdmin = Depends(require_api_admin)
PageAdmin = Depends(require_page_admin)


def safe_next(path: str | None) -> str:
    """Where to go after logging in: a dashboard path on this server, never elsewhere."""
    if path and path.startswith("/admin") and not path.startswith("//") and "\\" not in path:
        return path
    return "/admin/runs"


def set_login_cookie(response: Response, request: Request, ctx: ServerContext) -> None:
    """Log the browser in for ``--dashboard-login-hours`` (the cookie's Max-Age and the expiry
    it carries are the same)."""
    lifetime_s = max(1, round(ctx.settings.dashboard_login_hours * 3600))
    expires_at = int(time.time()) + lifetime_s
    response.set_cookie(
        COOKIE,
        issue_cookie(ctx.dashboard_secret, ctx.admin_key_hash, expires_at),
        max_age=lifetime_s,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_login_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


async def login_redirect(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    return RedirectResponse(f"{LOGIN_PATH}?next={quote(exc.next_path)}", status_code=303)
