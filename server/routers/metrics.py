"""/metrics: the proxy's figures in Prometheus' text format.

Open to anyone while the server binds a loopback address (a local Prometheus scrapes it
as is); on any other address it needs the admin key as a bearer token (Prometheus:
``authorization: {credentials: KEY}`` in the scrape config).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server import auth
from server.deps import Authorization, Ctx
from server.errors import documented

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (admin key unless the server binds loopback)",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **documented(401, 403)},
)
async def metrics(ctx: Ctx, authorization: Authorization = None) -> Response:
    if not ctx.settings.binds_loopback:
        auth.require_admin(await auth.identify(ctx, authorization))
    await ctx.metrics.state.refresh()
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
