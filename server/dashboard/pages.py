"""/admin: the dashboard's HTML pages, server-rendered with Jinja2, and its two scripts.

Pages show what ``views`` computes (the same data as /admin/api). The run page draws its
charts with Plotly, served from the installed ``plotly`` package (nothing is fetched from the
internet), and polls /admin/api for new points. Every page and script needs the admin key;
without it a page redirects to the login form.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import hashlib
import importlib.util
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from server.dashboard import access, views
from server.dashboard.access import PageAdmin
from server.dashboard.api import utc
from server.dashboard.transcript import transcript
from server.deps import Ctx
from server.errors import ResourceNotFound
from server.store.sessions import STATUSES
from server.store.stats import SessionFilter

HERE = Path(__file__).resolve().parent
PAGE_SIZE = 50
MAX_VIEW_TOKENS = 20_000  # per session in the token viewer; the JSON has them all
FAILED_LOGIN_DELAY_S = 0.5
NONE = "\u2013"  # an en dash: no value
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/admin", include_in_schema=False)


# ----- templates -------------------------------------------------------------------------------


def when(moment: datetime | float | None) -> str:
    if moment is None:
        return NONE
    if isinstance(moment, int | float):
        moment = datetime.fromtimestamp(moment, UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(moment: datetime | None) -> str:
    if moment is None:
        return "never"
    seconds = (datetime.now(UTC) - moment).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def number(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NONE
    return f"{value:.{digits}g}" if isinstance(value, float) else f"{value:,}"


def token_colour(logprob: float, loss_mask: int) -> str:
    """Background of a token: red (unlikely) to green (likely); grey when not trained."""
    if not loss_mask:
        return "background:#e9e9ee;color:#777"
    probability = math.exp(min(logprob, 0.0))
    return f"background:hsl({120 * probability:.0f},70%,82%)"


def shown(piece: str) -> str:
    """A token's text with whitespace made visible."""
    return piece.replace("\n", "↵\n").replace("\t", "⇥") if piece else "∅"


@functools.cache
def templates() -> Jinja2Templates:
    found = Jinja2Templates(directory=str(HERE / "templates"))
    found.env.filters.update(when=when, ago=ago, number=number, shown=shown)
    found.env.globals.update(token_colour=token_colour, statuses=STATUSES, exp=math.exp)
    return found


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    response = templates().TemplateResponse(request, name, context, status_code=status)
    response.headers.update(SECURITY_HEADERS)
    return response


# ----- login -----------------------------------------------------------------------------------


@router.get("")
async def home() -> RedirectResponse:
    return RedirectResponse("/admin/runs", status_code=303)


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> HTMLResponse:
    return render(request, "login.html", next=access.safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, ctx: Ctx) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0].strip()
    target = access.safe_next(form.get("next", [""])[0])
    if not key or not access.key_matches(ctx, key):
        await asyncio.sleep(FAILED_LOGIN_DELAY_S)
        error = "That is not the admin key." if key else "Enter the admin key."
        return render(request, "login.html", status=401, next=target, error=error)
    response = RedirectResponse(target, status_code=303)
    access.set_login_cookie(response, request, ctx)
    return response


@router.post("/logout")
async def logout() -> RedirectResponse:
    response = RedirectResponse(access.LOGIN_PATH, status_code=303)
    access.clear_login_cookie(response)
    return response


# ----- pages -----------------------------------------------------------------------------------


def _pages(total: int, offset: int) -> dict[str, int]:
    return {"page": offset // PAGE_SIZE + 1, "pages": max(1, math.ceil(total / PAGE_SIZE))}


@router.get("/runs", dependencies=[PageAdmin])
async def runs_page(request: Request, ctx: Ctx, page: int = 1) -> HTMLResponse:
    offset = (max(page, 1) - 1) * PAGE_SIZE
    found = await views.runs_page(ctx, PAGE_SIZE, offset)
    return render(request, "runs.html", runs=found, **_pages(found.total, offset))


@router.get("/runs/{run_id}", dependencies=[PageAdmin])
async def run_page(request: Request, ctx: Ctx, run_id: str) -> HTMLResponse:
    try:
        run = await views.run_detail(ctx, run_id)
    except ResourceNotFound:
        return render(request, "missing.html", status=404, what=f"run {run_id}")
    return render(request, "run.html", run=run)


FILTERS = ("run_id", "status", "task_id", "reward_min", "reward_max")
TIMES = ("created_after", "created_before")


def session_filters(params: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The search form's fields as filters (blank ones left out) and what could not be read."""
    filters: dict[str, Any] = {}
    problems = []
    for name in (*FILTERS, *TIMES):
        value = params.get(name, "").strip()
        if not value:
            continue
        try:
            if name == "status" and value not in STATUSES:
                raise ValueError(value)
            if name.startswith("reward_"):
                filters[name] = float(value)
            elif name in TIMES:
                filters[name] = utc(datetime.fromisoformat(value))
            else:
                filters[name] = value
        except ValueError:
            problems.append(f"{name}: cannot read {value!r}")
    return filters, problems


@router.get("/sessions", dependencies=[PageAdmin])
async def sessions_page(request: Request, ctx: Ctx, page: int = 1) -> HTMLResponse:
    filters, problems = session_filters(dict(request.query_params))
    offset = (max(page, 1) - 1) * PAGE_SIZE
    found = await views.sessions_page(ctx, SessionFilter(**filters), PAGE_SIZE, offset)
    query = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in filters.items()}
    return render(
        request,
        "sessions.html",
        sessions=found,
        filters=query,
        query=urlencode(query),
        problems=problems,
        **_pages(found.total, offset),
    )


@router.get("/sessions/{session_id}", dependencies=[PageAdmin])
async def session_page(request: Request, ctx: Ctx, session_id: str) -> HTMLResponse:
    try:
        session = await views.session_detail(ctx, session_id)
    except ResourceNotFound:
        return render(request, "missing.html", status=404, what=f"session {session_id}")
    budget, rows = MAX_VIEW_TOKENS, []
    for row in session.token_rows:
        rows.append((row, min(len(row.ids), budget)))
        budget = max(0, budget - len(row.ids))
    return render(
        request,
        "session.html",
        session=session,
        transcript=transcript(session.turns),
        rows=rows,
        truncated=budget == 0 and sum(len(r.ids) for r in session.token_rows) > MAX_VIEW_TOKENS,
    )


@router.get("/pool", dependencies=[PageAdmin])
async def engines_page(request: Request, ctx: Ctx) -> HTMLResponse:
    return render(request, "engines.html", engines=await views.engine_rows(ctx))


# ----- scripts ---------------------------------------------------------------------------------


def _plotly_bundle() -> Path:
    """plotly.js as the installed ``plotly`` package ships it (the package is not imported)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the plotly package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"


ASSETS = {"plotly.min.js": _plotly_bundle, "dashboard.js": lambda: HERE / "static/dashboard.js"}


@functools.cache
def _asset(name: str) -> tuple[bytes, bytes, str]:
    """The file, gzipped, and its ETag (read and compressed once)."""
    data = ASSETS[name]().read_bytes()
    return data, gzip.compress(data, 6), hashlib.sha256(data).hexdigest()[:32]


@router.get("/static/{name}", dependencies=[PageAdmin])
async def asset(request: Request, name: str) -> Response:
    if name not in ASSETS:
        raise ResourceNotFound(f"No dashboard file {name!r}.")
    data, compressed, etag = await asyncio.to_thread(_asset, name)
    headers = {
        "ETag": f'"{etag}"',
        "Cache-Control": "private, max-age=3600",
        "X-Content-Type-Options": "nosniff",
        "Vary": "Accept-Encoding",
    }
    if request.headers.get("if-none-match") == f'"{etag}"':
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        data, headers["Content-Encoding"] = compressed, "gzip"
    return Response(data, media_type="text/javascript", headers=headers)
