"""Secrets the server makes once and keeps in the store: random bytes by name.

``get_or_create`` is safe when several servers share a store and start together: each tries
to insert, the primary key lets one win, and every one of them reads the winner's secret.
"""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from server.store.tables import ServerSecret

DASHBOARD_COOKIE = "dashboard-cookie"  # signs the dashboard's login cookies
SECRET_BYTES = 32


async def get_or_create(maker: async_sessionmaker, name: str) -> bytes:
    """The secret called ``name``, made (``SECRET_BYTES`` random bytes) the first time."""
    found = await _read(maker, name)
    if found is not None:
        return found
    try:
        # A transaction of its own that starts by writing: on SQLite it takes the write lock
        # at once (a read first would make it a stale snapshot that cannot write).
        async with maker() as db, db.begin():
            db.add(ServerSecret(name=name, value=secrets.token_hex(SECRET_BYTES)))
    except IntegrityError:
        pass  # another server made it first: use theirs
    made = await _read(maker, name)
    assert made is not None, f"secret {name!r} was neither found nor made"
    return made


async def _read(maker: async_sessionmaker, name: str) -> bytes | None:
    async with maker() as db:
        value = await db.scalar(select(ServerSecret.value).where(ServerSecret.name == name))
    return None if value is None else bytes.fromhex(value)
