"""Alembic environment of proxrl's trajectory store (see server/store/database.py)."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from server.store.tables import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or os.environ.get("PROXRL_DB")
if not url:
    raise RuntimeError("no database URL: run `proxrl db upgrade --db URL` (or set PROXRL_DB)")


def run_migrations() -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations()
