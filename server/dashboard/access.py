"""Who may see the dashboard: the admin, by bearer key or by the login cookie.

The login form takes the admin key and sets a cookie that holds a token derived from it
(HMAC-SHA256 of a fixed label under the key), not the key itself: the cookie opens the
dashboard's pages and read-only JSON and nothing else, and changing the admin key logs every
browser out. The cookie is HttpOnly, SameSite=Strict (no other site can make the browser send
it) and Secure when the request came over https. Pages without the key redirect to the login
form; JSON answers 401.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated
from urllib.parse import quote

from fastapi import Cookie, Depends, Header, Request
from fastapi.responses import RedirectResponse, Response

from server import auth
from server.context import ServerContext
from server.deps import Ctx
from server.errors import Unauthorized

COOKIE = "proxrl_admin"
COOKIE_PATH = "/admin"
COOKIE_MAX_AGE_S = 7 * 24 * 3600
LOGIN_PATH = "/admin/login"
TOKEN_LABEL = b"proxrl dashboard session v1"


class LoginRequired(Exception):
    """A dashboard page was asked for without the key: answered with a redirect to login."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def cookie_token(admin_key: str) -> str:
    return hmac.new(admin_key.encode(), TOKEN_LABEL, hashlib.sha256).hexdigest()


def key_matches(ctx: ServerContext, key: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(key.encode()).hexdigest(), ctx.admin_key_hash)


async def is_admin(ctx: ServerContext, authorization: str | None, cookie: str | None) -> bool:
    """A bearer admin key, or the login cookie (a bearer key that is not the admin's: 401/403
    as everywhere else)."""
    if authorization:
        caller = await auth.identify(ctx, authorization)
        auth.require_admin(caller)
        return True
    expected = cookie_token(ctx.settings.admin_key or "")
    return cookie is not None and hmac.compare_digest(cookie, expected)


async def require_api_admin(
    ctx: Ctx,
    authorization: Annotated[str | None, Header()] = None,
    proxrl_admin: Annotated[str | None, Cookie()] = None,
) -> None:
    if not await is_admin(ctx, authorization, proxrl_admin):
        raise Unauthorized(
            "The dashboard API needs the admin key: 'Authorization: Bearer <key>' or the "
            "dashboard's login cookie."
        )


async def require_page_admin(
    request: Request,
    ctx: Ctx,
    proxrl_admin: Annotated[str | None, Cookie()] = None,
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


def set_login_cookie(response: Response, request: Request, admin_key: str) -> None:
    response.set_cookie(
        COOKIE,
        cookie_token(admin_key),
        max_age=COOKIE_MAX_AGE_S,
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
