"""Dependencies of the route handlers, as ``Annotated`` aliases (swap them in tests with
``app.dependency_overrides``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from server import auth
from server.context import ServerContext


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_context)]


async def get_caller(ctx: Ctx, authorization: Annotated[str | None, Header()] = None):
    return await auth.identify(ctx, authorization)


CallerDep = Annotated[auth.Caller, Depends(get_caller)]


async def get_admin(caller: CallerDep) -> auth.Caller:
    auth.require_admin(caller)
    return caller


AdminDep = Annotated[auth.Caller, Depends(get_admin)]
