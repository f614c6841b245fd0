"""Which replica leads: the one ``proxrl serve`` process, of those sharing a store, that drives
the engines' health and weight swaps.

On PostgreSQL the leader is the holder of a session-level advisory lock (``LOCK_KEY``, the same
for every replica of a store: advisory locks are per database) on a connection of its own that
it keeps open while it leads. ``Election.check`` runs every ``--leader-check-s``: a follower
tries to take the lock (``pg_try_advisory_lock``: never waits); the leader checks that its
connection still holds it, and stops leading at once when it does not answer within the
timeout. A leader that dies closes its connection (the kernel does, for a killed process) and
Postgres frees the lock; a leader cut off from the store stops leading at its next check, and
Postgres drops its connection by TCP keep-alive (set short on that connection, about 11 s),
later than the cut-off leader has stepped down, so two never lead at once.

The leader records where it is reached (``leader`` row: replica id, URL, its lock's backend
pid); a reader trusts the row only while that backend holds the lock (``current_leader``).

A replica checks that it still leads before it acts as the leader, with the store (``leads``):
what it writes in the transaction of that check (a weight swap's new version) is written only
if it leads, and before any replica that takes over reads the store (``leads`` locks the
``leader`` row, which a new leader rewrites as it takes the lock). That transaction is bounded
(``LEADS_IDLE_S``, ``LEADS_LOCK_S``): a replica cut off inside it does not hold the row long.
Its fencing token (``lead_token``) tells one lead from the next, even of one replica. The same
lock orders what a replica does outside the store against a takeover (``locked_leader``): a
weight swap's pause and resume of the engines are sent under it, so none lands under the swap
of a replica that took the lead after it was sent.

A SQLite store has one serving process: it always leads, and takes no lock.

This module knows nothing of engines or HTTP: it says whether this replica leads, and who does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from server.store.database import async_url, first_line
from server.store.tables import Leader, utcnow

log = logging.getLogger(__name__)

# pg_advisory_lock's bigint key; below 2**31, so pg_locks shows it as classid 0, objid LOCK_KEY.
LOCK_KEY = 0x70726C31  # "prl1"
LEADER_ROW = 1
QUERY_TIMEOUT_S = 5.0
# A ``leads`` transaction holds the leader row locked until it ends. A replica cut off from the
# store inside one leaves its backend idle in that transaction, the row locked, until Postgres
# notices the dead peer (store connections have no short keep-alive: hours), and a replica
# taking the lead, which rewrites the row first, would wait on it at every try. So Postgres ends
# such a transaction once it sits idle LEADS_IDLE_S (a live leader's goes from statement to
# statement in milliseconds), and one of its statements waits at most LEADS_LOCK_S for a lock
# (longer than LEADS_IDLE_S: the wait outlasts a cut-off holder of the row).
LEADS_IDLE_S = 2.0
LEADS_LOCK_S = 4.0
# Postgres drops a lock connection whose peer is gone after idle + interval * count seconds.
KEEPALIVE = {"tcp_keepalives_idle": 5, "tcp_keepalives_interval": 2, "tcp_keepalives_count": 3}

_HOLDER = text(
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
    f" AND classid = 0 AND objid = {LOCK_KEY}"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


@dataclass(frozen=True)
class LeaderRecord:
    replica_id: str
    url: str
    since: datetime


class Election:
    """This replica's side of the election (``check`` it every --leader-check-s; ``close`` at
    stop, which gives the lock up at once)."""

    def __init__(
        self, url: str, replica_id: str, advertise_url: str, timeout_s: float = QUERY_TIMEOUT_S
    ) -> None:
        self.replica_id, self.advertise_url, self.timeout_s = replica_id, advertise_url, timeout_s
        self.postgres = make_url(url).get_backend_name() != "sqlite"
        self._engine = create_async_engine(
            async_url(url),
            poolclass=NullPool,
            connect_args={"connect_timeout": max(1, int(timeout_s))} if self.postgres else {},
        )
        self._connection: AsyncConnection | None = None
        self.leading = False
        self._failing = False  # the last check failed (logged once for the episode)

    async def check(self) -> bool:
        """Whether this replica leads now (a follower tries to take the lead; a leader checks it
        still holds it). Any failure to reach the store within the timeout: not leading."""
        if not self.postgres:
            return await self._lead_alone()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.leading:
                    held = await self._still_held()
                else:
                    held = await self._take()
        except Exception as exc:  # the store away, slow, or the connection broken: step down
            if self.leading:
                log.warning("stopped leading: the store did not answer (%s)", first_line(exc))
            elif not self._failing:  # once per episode: a replica that can never lead says why
                log.warning("cannot take the lead: %s", first_line(exc))
            self._failing = True
            await self._drop()
            return False
        self._failing = False
        if held and not self.leading:
            log.info("leading the replicas (%s at %s)", self.replica_id, self.advertise_url)
        elif self.leading and not held:
            log.warning("stopped leading: the leader lock is no longer held")
            await self._drop()
        self.leading = held
        return held

    async def close(self) -> None:
        await self._drop()
        await self._engine.dispose()

    async def _lead_alone(self) -> bool:
        """A SQLite store's one serving process leads, whether or not its row is written (the
        row only tells ``GET /admin/leader``; it is tried once)."""
        if not self.leading:
            self.leading = True
            try:
                async with asyncio.timeout(self.timeout_s), self._engine.begin() as connection:
                    await _record(connection, self.replica_id, self.advertise_url, None)
            except Exception as exc:
                log.warning("could not record this server as the leader: %s", first_line(exc))
        return True

    async def _take(self) -> bool:
        if self._connection is None:
            connection = await self._engine.connect()
            self._connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
            for name, value in KEEPALIVE.items():
                await self._connection.execute(text(f"SET {name} = {int(value)}"))
        connection = self._connection
        locked = (
            await connection.execute(text(f"SELECT pg_try_advisory_lock({LOCK_KEY})"))
        ).scalar()
        if not locked:
            return False
        pid = (await connection.execute(text("SELECT pg_backend_pid()"))).scalar()
        await _record(connection, self.replica_id, self.advertise_url, pid)
        return True

    async def _still_held(self) -> bool:
        if self._connection is None:
            return False
        holders = (await self._connection.execute(_HOLDER)).scalars().all()
        pid = (await self._connection.execute(text("SELECT pg_backend_pid()"))).scalar()
        return pid in holders

    async def _drop(self) -> None:
        """Close the lock's connection (Postgres frees the lock with it)."""
        self.leading = False
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await connection.close()
        except Exception:  # a connection that cannot even close is gone: Postgres drops it
            await asyncio.shield(_invalidate(connection))


async def _invalidate(connection: AsyncConnection) -> None:
    try:
        await connection.invalidate()
    except Exception as exc:
        log.debug("leader connection already gone: %s", exc)


async def _record(connection: AsyncConnection, replica_id: str, url: str, pid: int | None) -> None:
    values = {"replica_id": replica_id, "url": url, "backend_pid": pid, "since": utcnow()}
    moved = await connection.execute(update(Leader).where(Leader.id == LEADER_ROW).values(values))
    if moved.rowcount == 0:
        await connection.execute(insert(Leader).values(id=LEADER_ROW, **values))


async def current_leader(db: AsyncSession) -> LeaderRecord | None:
    """The replica that leads now, or None (none has taken the lead since the last one died, or
    none ever did)."""
    row = await db.get(Leader, LEADER_ROW, populate_existing=True)
    if row is None:
        return None
    if db.get_bind().dialect.name == "postgresql":
        holders = set((await db.execute(_HOLDER)).scalars().all())
        if row.backend_pid not in holders:
            return None
    return LeaderRecord(row.replica_id, row.url, row.since)


async def leads(db: AsyncSession, replica_id: str) -> bool:
    """Whether ``replica_id`` leads now, by the store (see ``lead_token``)."""
    return await lead_token(db, replica_id) is not None


async def lead_token(
    db: AsyncSession, replica_id: str, hold_s: float = 0.0
) -> tuple[int, datetime] | None:
    """Whether ``replica_id`` leads now, by the store: its *fencing token* if so, else None. It
    leads if the ``leader`` row names it and its lock's backend holds the lock (always, on
    SQLite: its one process leads, token ``SQLITE_TOKEN``). The token (the
    lock's backend pid and when it took the lead) is new at every take: a replica that lost the
    lead and took it again has another, so an act begun under one lead (a weight swap) can
    check that it ends under the same one. On Postgres the row stays locked (``FOR UPDATE``)
    until ``db``'s transaction ends, so a replica taking the lead, which rewrites the row
    first, waits for that transaction: what it writes comes before the new leader reads
    anything. The transaction is ended by Postgres once idle ``LEADS_IDLE_S`` (plus ``hold_s``:
    see ``locked_leader``), and its statements wait at most ``LEADS_LOCK_S`` for a lock (then
    raise): a replica cut off inside it does not hold the row, and so the lead, for long."""
    if db.get_bind().dialect.name != "postgresql":
        return SQLITE_TOKEN
    leader = await locked_leader(db, hold_s)
    return leader[1] if leader is not None and leader[0] == replica_id else None


async def locked_leader(
    db: AsyncSession, hold_s: float = 0.0
) -> tuple[str, tuple[int, datetime]] | None:
    """PostgreSQL: the replica that leads now by the store, and its lead's fencing token (see
    ``lead_token``), or None when none does (the row names a replica whose lock is gone); the
    ``leader`` row locked until ``db``'s transaction ends, so no replica takes the lead (which
    rewrites the row first) before it ends. ``hold_s``: how long the caller may keep the
    transaction idle on top of ``LEADS_IDLE_S`` while it acts outside the store under that lock
    (a call to the engines that must land before any new leader acts: its own bound must be
    under ``hold_s``); Postgres ends the transaction past that, so a replica cut off inside it
    holds the row ``LEADS_IDLE_S + hold_s`` at most."""
    for name, seconds in (
        ("idle_in_transaction_session_timeout", LEADS_IDLE_S + hold_s),
        ("lock_timeout", LEADS_LOCK_S),
    ):
        await db.execute(text(f"SET LOCAL {name} = {int(seconds * 1000)}"))
    row = (
        await db.execute(
            select(Leader.replica_id, Leader.backend_pid, Leader.since)
            .where(Leader.id == LEADER_ROW)
            .with_for_update()
        )
    ).one_or_none()
    if row is None or row.backend_pid is None:
        return None
    if row.backend_pid not in set((await db.execute(_HOLDER)).scalars().all()):
        return None
    return row.replica_id, (row.backend_pid, row.since)


# SQLite's one serving process always leads, under one lead for its life.
SQLITE_TOKEN = (0, datetime.min)
