"""HTTP routes of the embedded engine: SGLang 0.5.23's native API.

See docs/architecture/sglang-protocol.md.

Each handler parses its body, calls one :class:`EngineService` method and returns SGLang's
shape. Bodies of ``/generate`` are checked by hand so bad input gets SGLang's error shapes (see
``protocol``); the other endpoints use FastAPI's validation, rendered as SGLang renders it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.common import weights_probe
from server.engine import protocol
from server.engine.protocol import EngineInputError
from server.engine.scheduler import UpdateResult
from server.engine.service import EngineService
from server.engine.settings import EngineSettings

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        status_code=400,
    )


def _result(result: UpdateResult, **extra) -> JSONResponse:
    body = {"success": result.success, "message": result.message, **extra}
    return JSONResponse(body, status_code=200 if result.success else 400)


def _schema_error(exc: ValidationError) -> str:
    """One line in the spirit of 0.5.23's serde messages, naming the offending key."""
    first = exc.errors()[0]
    # Drop the union-branch labels pydantic adds to the location (class and type names).
    path = [str(p) for p in first["loc"] if not str(p)[:1].isupper() and "[" not in str(p)]
    if first["type"] == "extra_forbidden":
        known = ", ".join(f"`{name}`" for name in protocol.SamplingParamsIn.model_fields)
        return f"unknown field `{path[-1]}`, expected one of {known}"
    return f"invalid value at `{'.'.join(path)}`: {first['msg']} (got {first['input']!r})"


class _Unauthorized(Exception):
    pass


async def _engine(request: Request) -> EngineService:
    return request.app.state.engine


def _check_key(request: Request, admin: bool) -> None:
    settings: EngineSettings = request.app.state.engine.settings
    key = settings.admin_api_key if admin and settings.admin_api_key else settings.api_key
    given = request.headers.get("authorization", "").encode()
    if key and not hmac.compare_digest(given, f"Bearer {key}".encode()):  # in constant time
        raise _Unauthorized()


async def _user(request: Request) -> None:
    _check_key(request, admin=False)


async def _admin(request: Request) -> None:
    _check_key(request, admin=True)


Engine = Annotated[EngineService, Depends(_engine)]
# Control bodies SGLang accepts as {} or absent.
OptionalPauseGeneration = Annotated[
    protocol.PauseGenerationIn, Body(default_factory=protocol.PauseGenerationIn)
]
OptionalContinueGeneration = Annotated[
    protocol.ContinueGenerationIn, Body(default_factory=protocol.ContinueGenerationIn)
]
OptionalDestroyWeightsUpdateGroup = Annotated[
    protocol.DestroyWeightsUpdateGroupIn, Body(default_factory=protocol.DestroyWeightsUpdateGroupIn)
]
OptionalBeginWeightUpdate = Annotated[
    protocol.BeginWeightUpdateIn, Body(default_factory=protocol.BeginWeightUpdateIn)
]
user = [Depends(_user)]
admin = [Depends(_admin)]


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # registered for it alone
    errors = exc.errors()
    where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    return _bad_request(f"{errors[0]['msg']} at {where}" if errors else "invalid request")


async def _unauthorized(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)


router = APIRouter()

# ----- generation ------------------------------------------------------------------------


@router.api_route("/generate", methods=["POST", "PUT"], dependencies=user)
async def generate(request: Request, engine: Engine) -> Response:
    raw = await request.body()
    try:
        body = protocol.GenerateRequestIn.model_validate(json.loads(raw))
    except json.JSONDecodeError as exc:
        return JSONResponse({"error": f"invalid JSON: {exc}"}, status_code=400)
    except ValidationError as exc:
        return JSONResponse({"error": _schema_error(exc)}, status_code=400)
    try:
        items, batch = engine.parse(body)
        if body.stream:
            chunks = engine.generate_stream(body, items, batch)
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        outputs = await _until_disconnect(request, engine.generate(body, items))
    except EngineInputError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    if outputs is None:
        return Response(status_code=499)
    return JSONResponse(outputs if batch else outputs[0])


# ----- control ---------------------------------------------------------------------------


@router.post("/abort_request", dependencies=admin)
async def abort_request(body: protocol.AbortRequestIn, engine: Engine) -> Response:
    if body.rid or body.abort_all:
        await asyncio.wrap_future(engine.scheduler.abort_soon(body.rid, body.abort_all))
    return Response(status_code=200)


@router.post("/pause_generation", dependencies=admin)
async def pause_generation(engine: Engine, body: OptionalPauseGeneration):
    await engine.run(lambda: engine.scheduler.pause(body.mode))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation", dependencies=admin)
async def continue_generation(engine: Engine, body: OptionalContinueGeneration):
    await engine.run(engine.scheduler.resume)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
async def flush_cache(engine: Engine) -> PlainTextResponse:
    # SGLang 0.5.23 takes ``?timeout=<seconds>``, but what it does is UNVERIFIED in the
    # reference (section 3.4), so we accept it and ignore it: the flush answers at once,
    # 200 or 400, and callers retry (as slime does).
    if await engine.run(engine.scheduler.flush_cache):
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)"
        )
    return PlainTextResponse(
        "Cache not flushed: there are running or waiting requests.", status_code=400
    )


@router.post("/update_weights_from_disk", dependencies=admin)
async def update_weights_from_disk(body: protocol.UpdateWeightsFromDiskIn, engine: Engine):
    return _result(await engine.update_from_disk(body), num_paused_requests=0)


@router.post("/init_weights_update_group", dependencies=admin)
async def init_weights_update_group(body: protocol.InitWeightsUpdateGroupIn, engine: Engine):
    return _result(await engine.init_group(body))


@router.post("/destroy_weights_update_group", dependencies=admin)
async def destroy_weights_update_group(
    engine: Engine,
    body: OptionalDestroyWeightsUpdateGroup,
):
    return _result(await engine.destroy_group(body.group_name))


@router.post("/begin_weight_update", dependencies=admin)
async def begin_weight_update(engine: Engine, body: OptionalBeginWeightUpdate):
    engine.update_session_open = True
    return {"success": True, "message": "Weight update session begun."}


@router.post("/end_weight_update", dependencies=admin)
async def end_weight_update(engine: Engine):
    engine.update_session_open = False
    return {"success": True, "message": "Weight update session ended."}


@router.post("/update_weights_from_distributed", dependencies=admin)
async def update_weights_from_distributed(
    body: protocol.UpdateWeightsFromDistributedIn, engine: Engine
):
    return _result(await engine.update_from_distributed(body))


@router.post("/update_weight_version", dependencies=admin)
async def update_weight_version(body: protocol.UpdateWeightVersionIn, engine: Engine):
    await engine.run(
        lambda: engine.scheduler.set_weight_version(body.new_version, body.abort_all_requests)
    )
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


def _lora_result(result: UpdateResult, engine: EngineService) -> JSONResponse:
    """SGLang's answer to a LoRA load or unload: 200 or 400, and the adapters now loaded."""
    body = {
        "success": result.success,
        "error_message": result.message,
        "loaded_adapters": engine.loaded_adapters(),
    }
    return JSONResponse(body, status_code=200 if result.success else 400)


@router.post("/load_lora_adapter", dependencies=admin)
async def load_lora_adapter(body: protocol.LoadLoraAdapterIn, engine: Engine) -> JSONResponse:
    return _lora_result(await engine.load_adapter(body), engine)


@router.post("/unload_lora_adapter", dependencies=admin)
async def unload_lora_adapter(body: protocol.UnloadLoraAdapterIn, engine: Engine) -> JSONResponse:
    return _lora_result(await engine.unload_adapter(body), engine)


class WeightsProbeIn(BaseModel):
    """proxrl's own (SGLang has no such endpoint): does this engine see a trainer's probe?"""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(max_length=4096)
    token: str = Field(min_length=1, max_length=weights_probe.TOKEN_CHARS)


@router.post("/weights_probe", dependencies=admin)
async def probe_weights(body: WeightsProbeIn) -> JSONResponse:
    """Whether the file at ``path`` holds ``token`` here (server/common/weights_probe.py)."""
    if (problem := weights_probe.name_problem(body.path)) is not None:
        return _bad_request(problem)
    problem = await weights_probe.read_problem_within(body.path, body.token)
    return JSONResponse({"success": problem is None, "message": problem or "readable"})


# ----- info and health -----------------------------------------------------------------


@router.get("/model_info", dependencies=user)
@router.get("/get_model_info", dependencies=user)
async def model_info(engine: Engine) -> dict:
    return engine.model_info()


@router.get("/server_info", dependencies=user)
@router.get("/get_server_info", dependencies=user)
async def server_info(engine: Engine) -> dict:
    return engine.server_info()


@router.get("/v1/loads", dependencies=user)
@router.get("/get_load", dependencies=user)
async def loads(engine: Engine) -> dict:
    return engine.loads()


@router.get("/health", dependencies=user)
async def health(engine: Engine) -> Response:
    return Response(status_code=200 if await engine.health() else 503)


@router.get("/health_generate", dependencies=user)
async def health_generate(engine: Engine) -> Response:
    return Response(status_code=200 if await engine.health_generate() else 503)


@router.get("/ready", dependencies=user)
async def ready(engine: Engine) -> Response:
    ok = engine.scheduler.alive and engine.scheduler.paused is None
    return Response(status_code=200 if ok else 503)


@router.get("/v1/models", dependencies=user)
async def list_models(engine: Engine) -> dict:
    return {"object": "list", "data": [_model_card(engine), *_adapter_cards(engine)]}


@router.get("/v1/models/{model_id:path}", dependencies=user)
async def get_model(model_id: str, engine: Engine) -> Response:
    card = _model_card(engine)  # the base model only, as SGLang (an adapter's name: a 404)
    if model_id != card["id"]:
        return JSONResponse(
            {
                "error": {
                    "message": f"The model '{model_id}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            status_code=404,
        )
    return JSONResponse(card)


def create_app(service: EngineService) -> FastAPI:
    """The engine's routes over ``service``; whoever made the service runs its scheduler."""
    app = FastAPI(title="proxrl embedded engine")
    app.state.engine = service
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(_Unauthorized, _unauthorized)
    app.include_router(router)
    return app


def _model_card(engine: EngineService) -> dict:
    return {
        "id": engine.served_model_name,
        "object": "model",
        "created": int(engine.started_at),
        "owned_by": "sglang",
        "root": engine.served_model_name,
        "parent": None,
        "max_model_len": engine.runner.context_length,
    }


def _adapter_cards(engine: EngineService) -> list[dict]:
    """The loaded LoRA adapters as SGLang lists them after the base model: a card each, its
    parent the base, no context length of its own (docs/architecture/sglang-protocol.md)."""
    return [
        {
            **_model_card(engine),
            "id": name,
            "root": path,
            "parent": engine.served_model_name,
            "max_model_len": None,
        }
        for name, path in engine.loaded_adapters().items()
    ]


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    except Exception as exc:  # the status is already 200: report in-band, as SGLang does
        log.exception("stream failed")
        error = {"message": str(exc), "type": "internal_error", "code": 500, "retryable": True}
        yield f"data: {json.dumps({'error': error})}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _until_disconnect(request: Request, work):
    """Await ``work``; cancel it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    finally:
        if not task.done():
            task.cancel()
