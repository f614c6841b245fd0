"""The OpenAI-compatible routes, under /v1 and under /sessions/{session_id}/v1."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path
from fastapi.responses import JSONResponse

from server import auth
from server.bounds import ID_LENGTH, MAX_INT
from server.deps import (
    AnthropicCallerDep,
    AnthropicPathCallerDep,
    BodyOffLoop,
    CallerDep,
    Ctx,
    PathCallerDep,
)
from server.errors import AuthenticationRequired, SessionNotOpen, documented
from server.proxy import (
    answer,
    anthropic,
    chat,
    completions,
    responses,
    responses_render,
    versions,
)
from server.proxy.anthropic_schemas import (
    ERROR_SHAPE,
    AnthropicErrorBody,
    CountTokensRequest,
    MessagesRequest,
)
from server.proxy.plan import Plan
from server.proxy.responses_schema import ResponseRequest
from server.proxy.schemas import ChatCompletionRequest, CompletionRequest
from server.proxy.session_cache import SessionState
from server.proxy.streaming import SSE, SSEResponse

router = APIRouter(tags=["OpenAI-compatible"], route_class=BodyOffLoop)
# The error shapes of routes that answer in another API's (server.errors.ErrorShape).
ERROR_SHAPES = [ERROR_SHAPE]
SessionHeader = Annotated[str | None, Header(alias="X-Session-Id", max_length=ID_LENGTH)]
SessionPath = Annotated[str, Path(min_length=1, max_length=ID_LENGTH)]
# A version of the session's run to serve the request with (docs/operations/lora-runs.md).
VersionHeader = Annotated[
    int | None,
    Header(
        alias=versions.VERSION_HEADER,
        ge=0,
        le=MAX_INT,
        description="A version of the session's run to serve the request (instead of its "
        "current one): as the model name <model>@<N>.",
    ),
]
# What a generation can answer: the JSON completion, or with stream: true its SSE events; bad
# input is a 400 (OpenAI's status, validation included), no engine to serve it a 503.
GENERATION = {
    200: {"content": {"application/json": {}, SSE: {}}},
    **documented(400, 401, 403, 404, 409, 410, 503),
}


async def _open_session(
    ctx: Ctx, caller: auth.Caller, path: str | None, header: str | None
) -> SessionState:
    state = await auth.session_for_generation(ctx, caller, path, header)
    if state.status != "open":
        raise SessionNotOpen(state.status)
    return state


async def _answer(
    ctx: Ctx,
    state: SessionState,
    plan: Plan,
    renderer: answer.Renderer,
    stream: bool,
    version: int | None,
) -> Any:
    plan = versions.with_header(plan, version)
    if stream:
        return SSEResponse(await answer.stream(ctx, state, plan, renderer), plan.headers)
    return JSONResponse(await answer.respond(ctx, state, plan, renderer), headers=plan.headers)


async def _chat(
    ctx: Ctx, state: SessionState, body: ChatCompletionRequest, version: int | None
) -> Any:
    plan = await chat.plan_chat(ctx, state, body)
    renderer = chat.ChatRenderer(ctx, plan, body.include_usage)
    return await _answer(ctx, state, plan, renderer, body.stream, version)


async def _completion(
    ctx: Ctx, state: SessionState, body: CompletionRequest, version: int | None
) -> Any:
    plan = await completions.plan_completion(ctx, state, body)
    renderer = completions.CompletionRenderer(ctx, plan, body.include_usage)
    return await _answer(ctx, state, plan, renderer, body.stream, version)


@router.post(
    "/v1/chat/completions",
    summary="Chat completion in the caller's session",
    responses=GENERATION,
)
async def chat_completions(
    body: ChatCompletionRequest,
    ctx: Ctx,
    caller: CallerDep,
    x_session_id: SessionHeader = None,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, None, x_session_id)
    return await _chat(ctx, session, body, x_proxrl_version)


@router.post(
    "/sessions/{session_id}/v1/chat/completions",
    summary="Chat completion, session in the path",
    responses=GENERATION,
)
async def session_chat_completions(
    session_id: SessionPath,
    body: ChatCompletionRequest,
    ctx: Ctx,
    caller: PathCallerDep,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, session_id, None)
    return await _chat(ctx, session, body, x_proxrl_version)


@router.post(
    "/v1/completions", summary="Text completion in the caller's session", responses=GENERATION
)
async def text_completions(
    body: CompletionRequest,
    ctx: Ctx,
    caller: CallerDep,
    x_session_id: SessionHeader = None,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, None, x_session_id)
    return await _completion(ctx, session, body, x_proxrl_version)


@router.post(
    "/sessions/{session_id}/v1/completions",
    summary="Text completion, session in the path",
    responses=GENERATION,
)
async def session_text_completions(
    session_id: SessionPath,
    body: CompletionRequest,
    ctx: Ctx,
    caller: PathCallerDep,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, session_id, None)
    return await _completion(ctx, session, body, x_proxrl_version)


async def _models(ctx: Ctx, run_id: str) -> dict:
    """The served model, then the run's aliases: cards alike but for their ids."""
    config = await ctx.run_configs.get(run_id)
    aliases = [] if config is None else config.model_aliases
    cards = [
        {
            "id": name,
            "object": "model",
            "created": int(ctx.started_at),
            "owned_by": "proxrl",
            "max_model_len": ctx.context_length,
        }
        for name in dict.fromkeys([ctx.model_name, *aliases])
    ]
    return {"object": "list", "data": cards}


@router.get(
    "/v1/models", summary="The served model and the run's aliases", responses=documented(400, 401)
)
async def list_models(ctx: Ctx, caller: CallerDep) -> dict:
    if caller.kind == "anonymous":
        raise AuthenticationRequired("Missing API key.", code="invalid_api_key")
    return await _models(ctx, caller.run_id or ctx.default_run_id)  # the admin: the default run


@router.get(
    "/sessions/{session_id}/v1/models",
    summary="The served model (session path)",
    responses=documented(400, 403, 404),
)
async def session_models(session_id: SessionPath, ctx: Ctx, caller: PathCallerDep) -> dict:
    state = await auth.session_for_generation(ctx, caller, session_id, None)
    return await _models(ctx, state.run_id)


# ----- the Responses API ----------------------------------------------------------------------

ResponseId = Annotated[str, Path(min_length=1, max_length=ID_LENGTH)]
STORED = documented(400, 401, 403, 404)


async def _response(
    ctx: Ctx, state: SessionState, body: ResponseRequest, version: int | None
) -> Any:
    plan = await responses.plan_response(ctx, state, body)
    renderer = responses_render.ResponsesRenderer(ctx, plan, body)
    return await _answer(ctx, state, plan, renderer, body.stream, version)


@router.post("/v1/responses", summary="Create a response (Responses API)", responses=GENERATION)
async def create_response(
    body: ResponseRequest,
    ctx: Ctx,
    caller: CallerDep,
    x_session_id: SessionHeader = None,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, None, x_session_id)
    return await _response(ctx, session, body, x_proxrl_version)


@router.post(
    "/sessions/{session_id}/v1/responses",
    summary="Create a response, session in the path",
    responses=GENERATION,
)
async def session_create_response(
    session_id: SessionPath,
    body: ResponseRequest,
    ctx: Ctx,
    caller: PathCallerDep,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, session_id, None)
    return await _response(ctx, session, body, x_proxrl_version)


@router.get("/v1/responses/{response_id}", summary="A stored response", responses=STORED)
async def get_response(
    response_id: ResponseId, ctx: Ctx, caller: CallerDep, x_session_id: SessionHeader = None
) -> dict:
    state = await auth.session_for_generation(ctx, caller, None, x_session_id)
    return await responses.stored_response(ctx, state, response_id)


@router.get(
    "/sessions/{session_id}/v1/responses/{response_id}",
    summary="A stored response (session path)",
    responses=STORED,
)
async def session_get_response(
    session_id: SessionPath, response_id: ResponseId, ctx: Ctx, caller: PathCallerDep
) -> dict:
    state = await auth.session_for_generation(ctx, caller, session_id, None)
    return await responses.stored_response(ctx, state, response_id)


@router.delete(
    "/v1/responses/{response_id}",
    summary="Delete a stored response (its turn stays for training)",
    responses=STORED,
)
async def delete_response(
    response_id: ResponseId, ctx: Ctx, caller: CallerDep, x_session_id: SessionHeader = None
) -> dict:
    state = await auth.session_for_generation(ctx, caller, None, x_session_id)
    return await responses.delete_response(ctx, state, response_id)


@router.delete(
    "/sessions/{session_id}/v1/responses/{response_id}",
    summary="Delete a stored response (session path)",
    responses=STORED,
)
async def session_delete_response(
    session_id: SessionPath, response_id: ResponseId, ctx: Ctx, caller: PathCallerDep
) -> dict:
    state = await auth.session_for_generation(ctx, caller, session_id, None)
    return await responses.delete_response(ctx, state, response_id)


# ----- Anthropic's Messages API ---------------------------------------------------------------

# Errors on these routes are in Anthropic's shape (ERROR_SHAPES, which server.main installs).
MESSAGES = {
    200: {"content": {"application/json": {}, SSE: {}}},
    **documented(400, 401, 403, 404, 409, 410, 503, shape=AnthropicErrorBody),
}
COUNTED = documented(400, 401, 403, 404, shape=AnthropicErrorBody)


async def _messages(
    ctx: Ctx, state: SessionState, body: MessagesRequest, version: int | None
) -> Any:
    plan = await anthropic.plan_messages(ctx, state, body)
    renderer = anthropic.MessagesRenderer(ctx, plan, body)
    return await _answer(ctx, state, plan, renderer, body.stream, version)


@router.post(
    "/v1/messages",
    summary="A message in the caller's session (Anthropic Messages API)",
    responses=MESSAGES,
    tags=["Anthropic-compatible"],
)
async def messages(
    body: MessagesRequest,
    ctx: Ctx,
    caller: AnthropicCallerDep,
    x_session_id: SessionHeader = None,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, None, x_session_id)
    return await _messages(ctx, session, body, x_proxrl_version)


@router.post(
    "/sessions/{session_id}/v1/messages",
    summary="A message, session in the path (Anthropic Messages API)",
    responses=MESSAGES,
    tags=["Anthropic-compatible"],
)
async def session_messages(
    session_id: SessionPath,
    body: MessagesRequest,
    ctx: Ctx,
    caller: AnthropicPathCallerDep,
    x_proxrl_version: VersionHeader = None,
):
    session = await _open_session(ctx, caller, session_id, None)
    return await _messages(ctx, session, body, x_proxrl_version)


@router.post(
    "/v1/messages/count_tokens",
    summary="The prompt's token count (Anthropic Messages API)",
    responses=COUNTED,
    tags=["Anthropic-compatible"],
)
async def count_message_tokens(
    body: CountTokensRequest,
    ctx: Ctx,
    caller: AnthropicCallerDep,
    x_session_id: SessionHeader = None,
) -> dict:
    state = await auth.session_for_generation(ctx, caller, None, x_session_id)
    return await anthropic.count_tokens(ctx, state, body)


@router.post(
    "/sessions/{session_id}/v1/messages/count_tokens",
    summary="The prompt's token count, session in the path (Anthropic Messages API)",
    responses=COUNTED,
    tags=["Anthropic-compatible"],
)
async def session_count_message_tokens(
    session_id: SessionPath, body: CountTokensRequest, ctx: Ctx, caller: AnthropicPathCallerDep
) -> dict:
    state = await auth.session_for_generation(ctx, caller, session_id, None)
    return await anthropic.count_tokens(ctx, state, body)
