"""/admin: publish weights, see the engines."""

from __future__ import annotations

from fastapi import APIRouter

from server import weights
from server.deps import AdminDep, Ctx
from server.errors import documented
from server.schemas import WeightGroupIn, WeightsIn, WeightsOut

router = APIRouter(prefix="/admin", tags=["admin"], responses=documented(401, 403))


@router.post(
    "/weights",
    response_model=WeightsOut,
    summary="Swap new weights into every engine",
    responses=documented(400, 404, 422, 502, 503),
)
async def publish_weights(body: WeightsIn, ctx: Ctx, _: AdminDep) -> WeightsOut:
    return await weights.publish(ctx, body)


@router.post(
    "/weights/group",
    summary="Have every engine join the trainer's weight group",
    responses=documented(400, 409, 422, 502, 503),
)
async def weight_group(body: WeightGroupIn, ctx: Ctx, _: AdminDep) -> dict:
    return await weights.form_group(ctx, body)


@router.get("/engines", summary="Each engine's URL, health, load and served version")
async def engines(ctx: Ctx, _: AdminDep) -> list[dict]:
    return [
        {
            "url": e.url,
            "healthy": e.healthy,
            "in_flight": e.in_flight,
            "weight_version": e.weight_version,
            "context_length": e.context_length,
            "tp_size": e.tp_size,
            "served_tokens": e.served_tokens,
            "failures": e.failures,
            "last_error": e.last_error,
        }
        for e in ctx.pool.engines
    ]
