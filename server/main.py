"""The proxy's app factory and ``proxrl serve``."""

from __future__ import annotations

import logging
import re
import secrets
import signal
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from sqlalchemy.engine import make_url

from server import auth, dashboard, errors, overload
from server.common.key_handover import hand_over
from server.deps import Authorization, Ctx
from server.engine_client import sglang
from server.limits import RequestLimits
from server.metrics import Metrics, RequestMetrics
from server.proxy import routes as proxy_routes
from server.rl import routes as rl_routes
from server.rl.schemas import Health
from server.settings import ServerSettings
from server.startup import first_problem, server_context


class SessionPathRedaction(logging.Filter):
    """Access-log lines without session ids in paths (``/sessions/{id}/v1/...``,
    ``/rl/sessions/{id}/...``): the id is the credential of the path form, and keys never go
    to a log."""

    SESSION_PATH = re.compile(r"/sessions/[^/?\s]+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self.SESSION_PATH.sub("/sessions/<id>", arg) if isinstance(arg, str) else arg
                for arg in record.args
            )
        return True


REDACT_SESSION_PATHS = SessionPathRedaction()
# Where a generated admin key goes when stdout is not a terminal (under --data-dir).
ADMIN_KEY_FILE = "admin-key"


def create_app(settings: ServerSettings) -> FastAPI:
    figures = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # uvicorn has configured its loggers by now; addFilter keeps one copy.
        logging.getLogger("uvicorn.access").addFilter(REDACT_SESSION_PATHS)
        async with server_context(settings, figures) as ctx:
            app.state.ctx = ctx
            yield

    app = FastAPI(title="proxrl", summary="An OpenAI-compatible RL proxy", lifespan=lifespan)
    # Added first, so innermost: a body is read (or refused) once the outer layers let it in.
    app.add_middleware(RequestLimits, settings=settings)
    errors.install(app, proxy_routes.ERROR_SHAPES)
    app.add_middleware(
        overload.InFlight,
        caps=request_caps(settings),
        per_session=settings.max_requests_per_session,
    )
    app.add_middleware(RequestMetrics, metrics=figures)
    for router in (proxy_routes.router, *rl_routes.ROUTERS):
        app.include_router(router)
    dashboard.install(app)

    @app.get(
        "/metrics",
        tags=["metrics"],
        summary="Prometheus metrics (admin key unless the server binds loopback)",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **errors.documented(401, 403)},
    )
    async def metrics(ctx: Ctx, authorization: Authorization = None) -> Response:
        """Open to anyone while the server binds a loopback address (a local Prometheus
        scrapes it as is); on any other address it needs the admin key as a bearer token
        (Prometheus: ``authorization: {credentials: KEY}`` in the scrape config)."""
        if not ctx.settings.binds_loopback:
            auth.require_admin(await auth.identify(ctx, authorization))
        await ctx.metrics.state.refresh()
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.head("/", include_in_schema=False)  # the GET's answer, without its body
    @app.get("/", tags=["health"], summary="200: the server answers (agents' probe, HEAD too)")
    async def root() -> dict[str, str]:
        """Claude Code probes its base URL with ``HEAD /`` before it starts; any client may.
        No key needed, nothing about the server disclosed; ``/health`` says whether an engine
        serves."""
        return {"service": "proxrl", "status": "ok"}

    @app.get(
        "/health",
        tags=["health"],
        summary="200 while an engine is in rotation",
        response_model=Health,
        responses={503: {"model": Health, "description": "No engine is in rotation."}},
    )
    async def health(ctx: Ctx) -> JSONResponse:
        healthy = len(ctx.pool.healthy)
        body = {"status": "ok" if healthy else "no engine", "engines_healthy": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    return app


def request_caps(settings: ServerSettings) -> dict[str, int]:
    """The requests in flight each class of caller may have (``server.overload.InFlight``)."""
    return {
        "admin": settings.max_requests_admin,
        "run": settings.max_requests_run,
        "session": settings.max_requests_session,
        "anonymous": settings.max_requests_anonymous,
    }


def connection_limits(settings: ServerSettings) -> overload.ConnectionLimits:
    cap = overload.connection_cap(settings.max_connections)
    if cap < settings.max_connections:
        print(
            f"connections: at most {cap} at once (--max-connections {settings.max_connections} "
            "does not fit the open-file limit; raise it with ulimit -n or LimitNOFILE=)",
            flush=True,
        )
    return overload.ConnectionLimits(cap, settings.header_timeout_s, settings.body_timeout_s)


def serve(settings: ServerSettings) -> None:
    # Whatever would stop it once started, before anything is created or started.
    problem = None
    if settings.engine == "sglang" and not settings.engine_urls:
        problem = sglang.missing(settings.sglang_module)
    problem = problem or first_problem(settings)
    if problem is not None:
        print(f"proxrl serve: {problem}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # At debug, aiosqlite logs every statement with its parameters: secrets among them.
    logging.getLogger("aiosqlite").setLevel(logging.INFO)
    # Threads that hand results back (the turn writer) should not wait 5 ms for the GIL.
    sys.setswitchinterval(0.001)
    disable_created_metrics()  # no *_created series: half the lines, nothing Prometheus needs
    if settings.admin_key is None:
        key = f"proxrl-admin-{secrets.token_urlsafe(24)}"
        settings = settings.model_copy(update={"admin_key": key})
        # Keys go to the person at the terminal, never to a log (stderr, or a journal's stdout).
        line = "admin key (generated; choose one with --admin-key or PROXRL_ADMIN_KEY)"
        hand_over(line, key, settings.data_dir / ADMIN_KEY_FILE)
    print(f"proxrl serves {settings.model_name} at {settings.base_url}/v1")
    store = make_url(settings.database_url).render_as_string(hide_password=True)
    print(f"store: {store}", flush=True)
    app = create_app(settings)
    # uvicorn drains requests in flight on SIGTERM, then raises the signal again once it has
    # stopped (the lifespan's cleanup done): a stop that was asked for ends the process with 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        http=overload.guarded_protocol(connection_limits(settings)),
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout_s,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
