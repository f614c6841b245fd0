"""A run's sessions read in pages, oldest first, for exports that never hold a whole run.

Keyset pagination on ``(created_at, id)`` (the ``ix_sessions_run_created`` index): each page
starts after the last session of the one before, so a page costs the same at the end of a large
run as at its start, and sessions created while an export runs are read if they come after the
cursor. This module knows nothing of turns, rows or the export's format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.store.tables import Session


@dataclass(frozen=True)
class SessionFilter:
    """Which of a run's sessions: by status (None: every status) and created at or after
    ``since`` (None: from the start)."""

    run_id: str
    statuses: Sequence[str] | None = None
    since: datetime | None = None

    def where(self) -> list[ColumnElement[bool]]:
        clauses = [Session.run_id == self.run_id]
        if self.statuses is not None:
            clauses.append(Session.status.in_(self.statuses))
        if self.since is not None:
            clauses.append(Session.created_at >= self.since)
        return clauses


@dataclass(frozen=True)
class Cursor:
    """Where the previous page ended: its last session's creation time and id."""

    created_at: datetime
    session_id: str


async def session_page(
    db: AsyncSession, chosen: SessionFilter, after: Cursor | None, limit: int
) -> list[Session]:
    """Up to ``limit`` chosen sessions after ``after``, by (created_at, id)."""
    query = select(Session).where(*chosen.where())
    if after is not None:
        query = query.where(
            or_(
                Session.created_at > after.created_at,
                and_(Session.created_at == after.created_at, Session.id > after.session_id),
            )
        )
    query = query.order_by(Session.created_at, Session.id).limit(limit)
    return list(await db.scalars(query))


async def count_sessions(db: AsyncSession, chosen: SessionFilter) -> int:
    return int(await db.scalar(select(func.count()).where(*chosen.where())) or 0)


def cursor_after(page: list[Session]) -> Cursor:
    last = page[-1]
    return Cursor(last.created_at, last.id)
