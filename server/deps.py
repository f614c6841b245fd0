"""Dependencies of the route handlers, as ``Annotated`` aliases (swap them in tests with
``app.dependency_overrides``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import anyio
from fastapi import Depends, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from server import auth
from server.context import ServerContext
from server.errors import AuthenticationRequired, InvalidKey
from server.proxy.prompts import REQUEST_BYTES

# A JSON body past this is parsed and validated on a worker thread (``BodyOffLoop``).
OFF_LOOP_BYTES = 256 * 1024


class BodyOffLoop(APIRoute):
    """A route whose JSON body, past ``OFF_LOOP_BYTES``, is parsed and validated on a worker
    thread. FastAPI does both on the event loop: a body of many messages took seconds of
    Python validators there, during which no other request (``/health`` included) was
    answered. The thread's validators let the loop run between them; FastAPI then meets an
    instance of its own model, which it takes as it is, or the errors it would have found."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or self._embed_body_fields:
            return handler

        async def route(request: Request) -> Response:
            body = await request.body()
            REQUEST_BYTES.set(len(body))  # a small body's prompt is made on the loop
            if len(body) <= OFF_LOOP_BYTES or not is_json(request):
                return await handler(request)
            value = await anyio.to_thread.run_sync(_validated, field, body)
            return await handler(_Parsed(request, body, value))

        return route


def _validated(field: Any, body: bytes) -> Any:
    """``body`` parsed and validated as FastAPI would; not JSON: the bytes (FastAPI answers)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    validated, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return validated


class _Parsed(Request):
    """The request as the route handler reads it: the body already read, its JSON already
    made."""

    def __init__(self, request: Request, body: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._given_body = body
        self._given_value = value

    async def body(self) -> bytes:
        return self._given_body

    async def json(self) -> Any:
        if self._given_value is self._given_body:  # not JSON: FastAPI's own error
            return json.loads(self._given_body)
        return self._given_value


def is_json(request: Request) -> bool:
    """As FastAPI decides to parse a body as JSON (its routes' ``strict_content_type``, the
    default): application/json or application/*+json; without a content type, not."""
    kind = request.headers.get("content-type")
    if not kind:
        return False
    media = kind.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_context)]

# Credentials are only hashed and compared, but still bounded before anything reads them: far
# longer than any key proxrl or an agent uses.
CREDENTIAL_MAX_CHARS = 4096
Authorization = Annotated[
    str | None, Header(max_length=CREDENTIAL_MAX_CHARS, description="Bearer <key>")
]


async def get_caller(ctx: Ctx, authorization: Authorization = None):
    return await auth.identify(ctx, authorization)


CallerDep = Annotated[auth.Caller, Depends(get_caller)]


async def get_path_caller(ctx: Ctx, authorization: Authorization = None) -> auth.Caller:
    """For /sessions/{id}/v1/...: the session id in the path is the credential, so a key
    proxrl did not issue (an agent's fixed key) counts as no key rather than a wrong one."""
    try:
        return await auth.identify(ctx, authorization)
    except InvalidKey:
        return auth.Caller("anonymous")


PathCallerDep = Annotated[auth.Caller, Depends(get_path_caller)]

# Anthropic's clients send their key as ``x-api-key``; ``Authorization: Bearer`` wins when given.
ApiKey = Annotated[
    str | None,
    Header(
        alias="x-api-key",
        max_length=CREDENTIAL_MAX_CHARS,
        description="The key, as Anthropic's clients send it (or Authorization: Bearer <key>).",
    ),
]


async def get_anthropic_caller(
    ctx: Ctx, authorization: Authorization = None, x_api_key: ApiKey = None
) -> auth.Caller:
    return await auth.identify_key(ctx, auth.presented_key(authorization, x_api_key))


AnthropicCallerDep = Annotated[auth.Caller, Depends(get_anthropic_caller)]


async def get_anthropic_path_caller(
    ctx: Ctx, authorization: Authorization = None, x_api_key: ApiKey = None
) -> auth.Caller:
    """``get_path_caller`` for Anthropic's clients: a key proxrl did not issue counts as none."""
    try:
        return await get_anthropic_caller(ctx, authorization, x_api_key)
    except InvalidKey:
        return auth.Caller("anonymous")


AnthropicPathCallerDep = Annotated[auth.Caller, Depends(get_anthropic_path_caller)]


async def get_keyed(caller: CallerDep) -> auth.Caller:
    """Any valid key (checked before anything is looked up, so no key learns nothing)."""
    if caller.kind == "anonymous":
        raise AuthenticationRequired("Missing API key: 'Authorization: Bearer <key>'.")
    return caller


KeyedDep = Annotated[auth.Caller, Depends(get_keyed)]


async def get_admin(caller: CallerDep) -> auth.Caller:
    auth.require_admin(caller)
    return caller


AdminDep = Annotated[auth.Caller, Depends(get_admin)]
