"""The admin dashboard: HTML pages under /admin and their JSON under /admin/api.

``install`` adds both to the app; everything here reads what the store and the engine pool
already hold, and writes nothing.
"""

from __future__ import annotations

from fastapi import FastAPI

from server.dashboard import access, api, pages


def install(app: FastAPI) -> None:
    app.include_router(api.router)
    app.include_router(pages.router)
    app.add_exception_handler(access.LoginRequired, access.login_redirect)
