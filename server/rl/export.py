"""A run's sessions as export records (``server.export.schema``), read a page at a time.

Each session is read by the very code that answers GET /rl/sessions/{id}
(``sessions.session_views``) and flattened into a record: free-form values become JSON text,
times ISO-8601, and each turn gets its ``alternative`` flag and ``loss_mask`` from the session's
rows. Pages follow ``(created_at, id)`` (``server.store.session_pages``), so memory holds one
page, whatever the run's size. Used by ``proxrl export`` (reading the store directly) and by
GET /rl/runs/{id}/export (streamed); it knows neither the command line nor HTTP. A session the
view withholds values of is left out with its reason (logged, and told to ``proxrl export``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from server.errors import InvalidRequest, RunNotFound
from server.export.options import ExportStatus
from server.export.writers import Writer
from server.rl.schemas import RowOut, SessionOut
from server.rl.sessions import session_views
from server.store import database
from server.store import runs as store_runs
from server.store import sessions as status
from server.store.database import Sessionmaker
from server.store.session_pages import SessionFilter, count_sessions, cursor_after, session_page

log = logging.getLogger(__name__)

STATUSES: dict[str, tuple[str, ...] | None] = {
    "consumed": (status.CONSUMED,),
    "trainable": (status.TRAINABLE,),
    "all": None,  # every status: open, ended, claimed, dropped, evaluated, served too
}
PAGE_SIZE = 100  # sessions read, encoded and written at a time


def chosen_sessions(run_id: str, which: ExportStatus, since: datetime | None) -> SessionFilter:
    return SessionFilter(run_id, STATUSES[which], since)


async def count(sessionmaker: Sessionmaker, chosen: SessionFilter) -> int:
    async with sessionmaker() as db:
        return await count_sessions(db, chosen)


def log_skip(session_id: str, reason: str) -> None:
    log.warning("export: session %s skipped: %s", session_id, reason)


async def record_pages(
    sessionmaker: Sessionmaker,
    chosen: SessionFilter,
    page_size: int = PAGE_SIZE,
    on_skip: Callable[[str, str], None] = log_skip,
) -> AsyncIterator[list[dict[str, Any]]]:
    """The chosen sessions' records, a page at a time, oldest first. A session holding stored
    values no file can carry (its view's ``withheld``: an older version's lone surrogate or
    deep nesting) is left out, and ``on_skip`` hears its id and why: one such session does not
    stop the export, nor goes into it with holes."""
    after = None
    while True:
        async with sessionmaker() as db:
            page = await session_page(db, chosen, after, page_size)
        records = []
        for view in await session_views(sessionmaker, page) if page else []:
            if view.withheld:
                on_skip(view.session_id, skip_reason(view.withheld))
            else:
                records.append(session_record(view))
        if records:
            yield records
        if len(page) < page_size:
            return
        after = cursor_after(page)


def skip_reason(withheld: dict[str, str]) -> str:
    return "; ".join(f"{where}: {problem}" for where, problem in withheld.items())


async def file_chunks(
    sessionmaker: Sessionmaker, chosen: SessionFilter, writer: Writer
) -> AsyncIterator[bytes]:
    """The export file, a page's bytes at a time (encoding leaves the event loop)."""
    async for records in record_pages(sessionmaker, chosen):
        yield await asyncio.to_thread(writer.page, records)
    yield await asyncio.to_thread(writer.close)


async def run_id_of(sessionmaker: Sessionmaker, reference: str) -> str:
    """The id of the run ``reference`` names: its id, or else its name when one run has it
    (the server's first run is named "default")."""
    async with sessionmaker() as db:
        if await store_runs.get_run(db, reference) is not None:
            return reference
        named = await store_runs.runs_named(db, reference)
    if not named:
        raise RunNotFound(reference)
    if len(named) > 1:
        ids = ", ".join(run.id for run in named)
        raise InvalidRequest(f"{len(named)} runs are named {reference!r}; give one's id: {ids}")
    return named[0].id


def session_record(view: SessionOut) -> dict[str, Any]:
    """A session's export record (``server.export.schema.SESSION``) from its REST view."""
    trained = _trained_tokens(view.rows)
    return {
        "session_id": view.session_id,
        "run_id": view.run_id,
        "task_id": view.task_id,
        "group_id": view.group_id,
        "eval": view.eval,
        "production": view.production,
        "status": view.status,
        "drop_reason": view.drop_reason,
        "metadata_json": _json(view.metadata),
        "created_at": view.created_at.isoformat(),
        "ended_at": view.ended_at.isoformat() if view.ended_at else None,
        "turn_count": view.turn_count,
        "row_count": view.row_count,
        "conversations": view.conversations,
        "breaks": view.breaks,
        "retries": view.retries,
        "reward": view.reward,
        "rewards": [{"target": t, "reward": r} for t, r in view.rewards.items()],
        "turns": [
            {
                "completion_id": turn.completion_id,
                "request_id": turn.request_id,
                "turn_index": turn.turn_index,
                "row_index": turn.row_index,
                "conversation": turn.conversation,
                "surface": turn.surface,
                "model": turn.model,
                "finish_reason": turn.finish_reason,
                "extends_previous": turn.extends_previous,
                "alternative": trained[turn.completion_id][0],
                "prompt_ids": turn.prompt_ids,
                "completion_ids": turn.completion_ids,
                "logprobs": turn.logprobs,
                "versions": turn.versions,
                "loss_mask": trained[turn.completion_id][1],
                "reward": turn.reward,
                "messages_json": _json(turn.messages),
                "tools_json": _json(turn.tools),
                "response_json": _json(turn.response),
                "sampling_json": _json(turn.sampling),
                "engine": turn.engine,
                "resubmits": turn.resubmits,
                "created_at": turn.created_at.isoformat(),
            }
            for turn in view.turns
        ],
        "rows": [
            {
                "row_index": row.row_index,
                "input_ids": row.input_ids,
                "loss_mask": row.loss_mask,
                "logprobs": row.logprobs,
                "versions": row.versions,
                "turns": row.turns,
            }
            for row in view.rows
        ],
    }


def _trained_tokens(rows: list[RowOut]) -> dict[str, tuple[bool, list[int]]]:
    """Each turn's ``alternative`` flag and the loss mask over its sampled tokens: its row's,
    zero for an alternative without a reward of its own (the trainer trains nothing of it)."""
    found: dict[str, tuple[bool, list[int]]] = {}
    for row in rows:
        for turn in row.turns:
            mask = row.loss_mask[turn["start"] : turn["end"]]
            if turn["alternative"] and turn["reward"] is None:
                mask = [0] * len(mask)
            found[turn["completion_id"]] = (turn["alternative"], mask)
    return found


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def export_file(
    url: str,
    chosen: SessionFilter,
    writer: Writer,
    out: Path,
    on_total: Callable[[int], None] = lambda total: None,
    on_page: Callable[[int], None] = lambda sessions: None,
    on_skip: Callable[[str, str], None] = log_skip,
) -> int:
    """Write the chosen sessions of the store at ``url`` to ``out`` (through ``out.partial``,
    renamed at the end, so ``out`` is never half written, and removed if the export fails or
    is interrupted); how many sessions it holds. ``on_total`` hears how many there are to
    write, ``on_page`` each page's count, ``on_skip`` each session left out and why."""
    engine = database.connect(url)
    try:
        sessionmaker = database.sessionmaker(engine)
        chosen = dataclasses.replace(chosen, run_id=await run_id_of(sessionmaker, chosen.run_id))
        on_total(await count(sessionmaker, chosen))
        partial = out.with_name(out.name + ".partial")
        written = 0
        try:
            with partial.open("wb") as file:
                async for records in record_pages(sessionmaker, chosen, on_skip=on_skip):
                    file.write(await asyncio.to_thread(writer.page, records))
                    written += len(records)
                    on_page(len(records))
                file.write(writer.close())
            partial.replace(out)
        except BaseException:  # a full disk, Ctrl-C: no half file is left behind
            partial.unlink(missing_ok=True)
            raise
        return written
    finally:
        await engine.dispose()
