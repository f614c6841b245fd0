"""What an export asks for: which sessions (``ExportStatus``, ``since``) and which file
(``ExportFormat``). Shared by ``proxrl export`` and GET /rl/runs/{id}/export; light to import
(the command line reads it before it knows it will export)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, WithJsonSchema

ExportStatus = Literal["consumed", "trainable", "all"]
ExportFormat = Literal["jsonl", "parquet"]
STATUS_HELP = (
    "consumed (trained), trainable (ready, not yet claimed), or all (every status: open, ended, "
    "claimed, dropped, evaluated and served too)."
)
SINCE_HELP = (
    "Only sessions created at or after this: an ISO-8601 time (UTC when it names no zone) or a "
    "duration back from now (90s, 30m, 2h, 7d, 1w)."
)

SINCE_LENGTH = 64
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def since_time(value: Any) -> Any:
    """An ISO-8601 time or a duration back from now (``SINCE_HELP``) as a UTC datetime (the
    store compares times as UTC text); anything else raises ValueError (a 422, or the command
    line's message)."""
    if isinstance(value, datetime):
        return _utc(value)
    if not isinstance(value, str):
        return value  # pydantic refuses it as no datetime
    if len(value) > SINCE_LENGTH:
        raise ValueError(f"at most {SINCE_LENGTH} characters")
    text = value.strip()
    duration = _DURATION.fullmatch(text)
    if duration:
        amount, unit = duration.groups()
        try:
            return datetime.now(UTC) - timedelta(seconds=float(amount) * _UNIT_S[unit])
        except OverflowError:
            raise ValueError(f"{value!r} reaches back before the year 1") from None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{value!r} is neither an ISO-8601 time (2026-11-24T09:00:00Z) nor a duration "
            "(30m, 2h, 7d)"
        ) from None
    return _utc(moment)


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+01:00 is before the year 1 in UTC
        raise ValueError(f"{moment.isoformat()} is out of range in UTC") from None


# A string in the API's document: a duration is no date-time, and must not read as off-schema.
Since = Annotated[
    datetime,
    BeforeValidator(since_time),
    WithJsonSchema(
        {"type": "string", "maxLength": SINCE_LENGTH, "examples": ["2026-11-24T09:00:00Z", "2h"]}
    ),
]
