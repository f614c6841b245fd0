"""Turns: written in batches by the server, read back as the exact tokens that were served."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Annotated, Any

from pydantic import Field
from sqlalchemy import Connection, Dialect, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import load_only

from server.store.packing import pack_floats, pack_ints, unpack_floats, unpack_ints
from server.store.rows import TurnTokens
from server.store.tables import Session, Turn, utcnow


@dataclass(kw_only=True)
class TurnFields:
    """A turn's fields: what the server keeps of one served completion and what
    GET /rl/sessions/{id} shows of it. Listed here once: :class:`TurnRecord` (the write) and the
    REST answer (``server.rl.schemas.TurnOut``) extend it, and the table's columns are these
    (the token lists packed) plus what :func:`_to_row` derives."""

    completion_id: str
    request_id: str  # the choices of one request (n > 1) share it
    surface: Annotated[
        str,
        Field(
            description="The API the request came in on: chat (Chat Completions), completions, "
            "responses (the Responses API) or messages (Anthropic Messages); ``messages`` holds "
            "its conversation in that API's own form."
        ),
    ]
    model: Annotated[str | None, Field(description="The model name the request asked for.")]
    turn_index: int
    row_index: int
    extends_previous: bool  # it continues a turn of the previous request in that turn's row
    conversation: Annotated[
        int,
        Field(
            description="The conversation of the session it belongs to, from 0 in order of "
            "first request: the agent's main thread and each side request's (a title, a "
            "summary, a sub-agent) are apart."
        ),
    ]
    messages: list[Any] | None  # its request's conversation, as sent (None: a text prompt)
    tools: list[Any] | None
    response: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: Annotated[
        list[int], Field(description="The policy version of each completion token.")
    ]
    finish_reason: str
    sampling: dict[str, Any]
    engine: str | None
    resubmits: int


@dataclass(kw_only=True)
class TurnRecord(TurnFields):
    """One served completion, as plain data, ready to store."""

    session_id: str
    run_id: str
    new_row: bool = True  # this turn opened a row
    is_break: bool = False  # ...because it changed its conversation's history
    new_conversation: bool = False  # it is the first turn of its conversation


# The token lists are stored packed (server.store.packing): how to pack and unpack each.
_PACKED: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    "prompt_ids": (pack_ints, unpack_ints),
    "completion_ids": (pack_ints, unpack_ints),
    "logprobs": (pack_floats, unpack_floats),
    "versions": (pack_ints, unpack_ints),
}
_SERVED = [f.name for f in fields(TurnFields)]
_RECORDED = [f.name for f in fields(TurnRecord) if f.name in Turn.__table__.columns]


def _to_row(record: TurnRecord, now: datetime) -> dict[str, Any]:
    row = {name: getattr(record, name) for name in _RECORDED}
    for name, (pack, _) in _PACKED.items():
        row[name] = pack(row[name])
    row["prompt_tokens"] = len(record.prompt_ids)
    row["completion_tokens"] = len(record.completion_ids)
    row["created_at"] = now
    return row


def served_fields(turn: Turn) -> dict[str, Any]:
    """The :class:`TurnFields` of a stored turn, its token lists unpacked."""
    values = {name: getattr(turn, name) for name in _SERVED}
    for name, (_, unpack) in _PACKED.items():
        values[name] = unpack(values[name])
    return values


# Built once: compiling statements is a large part of a small write.
_INSERT_TURNS = insert(Turn)
_SESSIONS = Session.__table__.c
_BUMP_SESSION = (
    update(Session)
    .where(_SESSIONS.id == bindparam("sid"))
    .values(
        turn_count=_SESSIONS.turn_count + bindparam("turns"),
        row_count=_SESSIONS.row_count + bindparam("rows"),
        breaks=_SESSIONS.breaks + bindparam("breaks"),
        conversations=_SESSIONS.conversations + bindparam("conversations"),
        last_activity_at=bindparam("now"),
        engine=bindparam("engine"),
    )
)
_TURN_FIELDS = [column.name for column in Turn.__table__.columns if column.name != "id"]


def _turn_rows(records: list[TurnRecord]) -> list[dict[str, Any]]:
    now = utcnow()
    return [_to_row(record, now) for record in records]


def _session_bumps(records: list[TurnRecord], now: datetime) -> list[dict[str, Any]]:
    by_session: dict[str, list[TurnRecord]] = {}
    for record in records:
        by_session.setdefault(record.session_id, []).append(record)
    return [
        {
            "sid": session_id,
            "turns": len(group),
            "rows": sum(r.new_row for r in group),
            "breaks": sum(r.is_break for r in group),
            "conversations": sum(r.new_conversation for r in group),
            "now": now,
            "engine": group[-1].engine,
        }
        for session_id, group in by_session.items()
    ]


def insert_turns(db: Connection, records: list[TurnRecord]) -> None:
    """Add the turns and bump their sessions' counters, two executemany statements in all
    (plain Core: the reference :class:`TurnInserter`, which the server uses, is tested
    against)."""
    rows = _turn_rows(records)
    db.execute(_INSERT_TURNS, rows)
    db.execute(_BUMP_SESSION, _session_bumps(records, rows[0]["created_at"]))


class _DriverStatement:
    """A statement compiled once for one dialect, executed on the driver's cursor with the
    values converted by SQLAlchemy's own bind processors: the rows are those Core would write."""

    def __init__(self, statement: Any, dialect: Dialect, columns: dict[str, Any]) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(columns))
        self.sql = str(compiled)
        self.keys = list(compiled.positiontup or []) if compiled.positional else None
        self.processors = {}
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None:
                self.processors[name] = processor

    def parameters(self, values: dict[str, Any]) -> tuple | dict:
        converted = {
            name: (self.processors[name](value) if name in self.processors else value)
            for name, value in values.items()
        }
        if self.keys is None:
            return converted
        return tuple(converted[name] for name in self.keys)

    def run(self, cursor: Any, rows: list[dict[str, Any]]) -> int:
        """Execute for every row; returns the bytes of text and binary values sent."""
        parameters = [self.parameters(row) for row in rows]
        cursor.executemany(self.sql, parameters)
        values = (v for p in parameters for v in (p if isinstance(p, tuple) else p.values()))
        return sum(len(v) for v in values if isinstance(v, str | bytes))


class TurnInserter:
    """:func:`insert_turns` on a DBAPI connection, past SQLAlchemy's execution machinery.

    The turn write is on every request's path; in a busy server, Core's per-statement work
    (execution context, parameter processing) cost ~0.6 ms of CPU per request, four times the
    insert itself. The SQL and the value conversions still come from SQLAlchemy (compiled once
    for the dialect), so the rows are the ones Core writes
    (tests/integration/test_turn_writer.py)."""

    def __init__(self, dialect: Dialect) -> None:
        self._insert = _DriverStatement(
            _INSERT_TURNS, dialect, {name: None for name in _TURN_FIELDS}
        )
        self._bump = _DriverStatement(_BUMP_SESSION, dialect, {})

    def __call__(self, connection: Any, records: list[TurnRecord]) -> int:
        """Write ``records`` in one transaction on the DBAPI ``connection`` and commit; returns
        about how many bytes that wrote (the turns' text and binary values)."""
        rows = _turn_rows(records)
        cursor = connection.cursor()
        try:
            written = self._insert.run(cursor, rows)
            self._bump.run(cursor, _session_bumps(records, rows[0]["created_at"]))
            connection.commit()
            return written
        except BaseException:
            connection.rollback()
            raise
        finally:
            cursor.close()


async def turns_by_session(db: AsyncSession, session_ids: list[str]) -> dict[str, list[Turn]]:
    """The turns of each of the sessions, by turn_index, in one query."""
    turns: dict[str, list[Turn]] = {sid: [] for sid in session_ids}
    query = select(Turn).where(Turn.session_id.in_(session_ids)).order_by(Turn.turn_index)
    for turn in await db.scalars(query):
        turns[turn.session_id].append(turn)
    return turns


@dataclass(frozen=True)
class ConversationEnds:
    """What the proxy reloads of one conversation of a session: its first turn (its opening)
    and its most recent request's turns (several when it asked for n > 1), by turn_index."""

    conversation: int
    first: Turn
    last: list[Turn]
    # Up to EARLIER of its turns before that request, latest first: where the turns it retried
    # and the turn it continued are (``session_cache`` reads them out).
    earlier: list[Turn] = field(default_factory=list)


EARLIER = 64  # turns of a conversation read back before its latest request


async def recent_conversations(
    db: AsyncSession, session_id: str, limit: int
) -> list[ConversationEnds]:
    """The session's ``limit`` most recently active conversations, least recent first."""
    spans = (
        await db.execute(
            select(Turn.conversation, func.min(Turn.turn_index), func.max(Turn.turn_index))
            .where(Turn.session_id == session_id)
            .group_by(Turn.conversation)
        )
    ).all()
    spans = sorted(spans, key=lambda span: span[2])[-limit:] if limit > 0 else []
    if not spans:
        return []
    wanted = {index for span in spans for index in span[1:]}
    ends = {
        turn.turn_index: turn
        for turn in await db.scalars(
            select(Turn).where(Turn.session_id == session_id, Turn.turn_index.in_(wanted))
        )
    }
    requests = {ends[last].request_id for _, _, last in spans}
    query = select(Turn).where(Turn.session_id == session_id, Turn.request_id.in_(requests))
    by_request: dict[str, list[Turn]] = {}
    for turn in await db.scalars(query.order_by(Turn.turn_index)):
        by_request.setdefault(turn.request_id, []).append(turn)
    found = []
    for conversation, first, last in spans:
        latest = by_request[ends[last].request_id]
        earlier = await db.scalars(
            select(Turn)
            .where(
                Turn.session_id == session_id,
                Turn.conversation == conversation,
                Turn.turn_index < latest[0].turn_index,
            )
            .order_by(Turn.turn_index.desc())
            .limit(EARLIER)
        )
        found.append(ConversationEnds(int(conversation), ends[first], latest, list(earlier)))
    return found


async def row_tails(db: AsyncSession, session_id: str, rows: set[int]) -> dict[int, str]:
    """The completion id of the last turn of each of the session's ``rows``."""
    if not rows:
        return {}
    last = (
        select(func.max(Turn.turn_index))
        .where(Turn.session_id == session_id, Turn.row_index.in_(rows))
        .group_by(Turn.row_index)
    )
    query = select(Turn.row_index, Turn.completion_id).where(
        Turn.session_id == session_id, Turn.turn_index.in_(last)
    )
    return {int(row): str(completion_id) for row, completion_id in await db.execute(query)}


async def last_turn_index(db: AsyncSession, session_id: str) -> int | None:
    """The session's highest turn_index (None: no turns)."""
    return await db.scalar(select(func.max(Turn.turn_index)).where(Turn.session_id == session_id))


async def last_row_index(db: AsyncSession, session_id: str) -> int | None:
    """The highest training row any of the session's turns belongs to (None: no turns)."""
    return await db.scalar(select(func.max(Turn.row_index)).where(Turn.session_id == session_id))


def sampled_temperature(turn: Turn) -> float | None:
    """The temperature the turn was sampled at, as its sampling settings recorded it."""
    value = (turn.sampling or {}).get("temperature")
    return float(value) if isinstance(value, int | float) else None


def tokens_of(turn: Turn, reward: float | None = None) -> TurnTokens:
    return TurnTokens(
        completion_id=turn.completion_id,
        request_id=turn.request_id,
        turn_index=turn.turn_index,
        row_index=turn.row_index,
        extends_previous=turn.extends_previous,
        messages=turn.messages,
        tools=turn.tools,
        prompt_ids=unpack_ints(turn.prompt_ids),
        completion_ids=unpack_ints(turn.completion_ids),
        logprobs=unpack_floats(turn.logprobs),
        versions=unpack_ints(turn.versions),
        temperature=sampled_temperature(turn),
        reward=reward,
        surface=turn.surface,
        conversation=turn.conversation,
        finish_reason=turn.finish_reason,
    )


async def session_turn(db: AsyncSession, session_id: str, completion_id: str) -> Turn | None:
    """The session's turn with that completion id (a Responses API response id), if any: what
    it recorded of its request and answer only, not its packed tokens (a chain of responses is
    walked a turn at a time, and a long prompt's tokens would be read at every link)."""
    fields = (Turn.id, Turn.surface, Turn.messages, Turn.response)
    query = (
        select(Turn)
        .options(load_only(*fields))
        .where(Turn.session_id == session_id, Turn.completion_id == completion_id)
    )
    return await db.scalar(query)


async def replace_response(db: AsyncSession, turn_id: int, response: dict[str, Any]) -> None:
    """Set what a turn records of its answer (a deleted Responses API response is marked so;
    its tokens stay for training). The caller commits."""
    await db.execute(update(Turn).where(Turn.id == turn_id).values(response=response))
