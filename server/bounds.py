"""Bounds on every value a request carries, before it meets SQL (64-bit integers), a
timedelta or an engine: counts and numbers fit 32 bits, ids are as long as the store keeps
them, and strings that go to a text column (ids, names, paths) hold no NUL character, which
PostgreSQL's text cannot store. Shared by every surface (OpenAI routes, REST, dashboard) and shown
in /openapi.json."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from pydantic import AfterValidator, Field, StringConstraints
from pydantic_core import PydanticCustomError

from server.store.run_config import MAX_COUNT


def _without_nul(value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise PydanticCustomError(
            "nul_character", "must not hold a NUL character (\\u0000): the store cannot keep it"
        )
    return value


# On every string bound for a text column of the store (JSON values may hold NUL: it is escaped).
NoNul = AfterValidator(_without_nul)

MAX_INT = MAX_COUNT
ID_LENGTH = 100
NAME_LENGTH = 200
Id = Annotated[str, StringConstraints(min_length=1, max_length=ID_LENGTH), NoNul]
Name = Annotated[str, StringConstraints(max_length=NAME_LENGTH), NoNul]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
PathId = Annotated[str, Path(min_length=1, max_length=ID_LENGTH), NoNul]
QueryId = Annotated[str | None, Query(min_length=1, max_length=ID_LENGTH), NoNul]
QueryName = Annotated[str | None, Query(max_length=NAME_LENGTH), NoNul]
Limit = Annotated[int, Query(ge=1, le=1000, description="Items per page.")]
Offset = Annotated[int, Query(ge=0, le=MAX_INT, description="Items to skip.")]
StepNumber = Annotated[int, Query(ge=0, le=MAX_INT, description="A trainer step number.")]
FilePath = Annotated[str, StringConstraints(min_length=1, max_length=4096), NoNul]
# A path the store records (a run's weights_path: VARCHAR(1000)), refused before it is used.
STORED_PATH_LENGTH = 1000
StoredPath = Annotated[str, StringConstraints(min_length=1, max_length=STORED_PATH_LENGTH), NoNul]
# A host name (RFC 1123 labels) or an IPv4/IPv6 address, as a socket can be given it.
Host = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:-]+$")
]
DtypeName = Annotated[str, StringConstraints(min_length=1, max_length=32)]
Shape = Annotated[list[Count], Field(max_length=16)]
