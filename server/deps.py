"""Dependencies of the route handlers, as ``Annotated`` aliases (swap them in tests with
``app.dependency_overrides``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from server import auth
from server.context import ServerContext
from server.errors import AuthenticationRequired, InvalidKey


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
    return await auth.identify_key(ctx, auth.bearer(authorization) or x_api_key or None)


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
