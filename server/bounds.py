"""Bounds on every value a request carries, before it meets SQL (64-bit integers), a
timedelta or an engine: counts and numbers fit 32 bits, ids are as long as the store keeps
them. Shared by every surface (OpenAI routes, REST, dashboard) and shown in /openapi.json."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from pydantic import Field, StringConstraints

from server.store.run_config import MAX_COUNT

MAX_INT = MAX_COUNT
ID_LENGTH = 100
NAME_LENGTH = 200
Id = Annotated[str, StringConstraints(min_length=1, max_length=ID_LENGTH)]
Name = Annotated[str, StringConstraints(max_length=NAME_LENGTH)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
PathId = Annotated[str, Path(min_length=1, max_length=ID_LENGTH)]
QueryId = Annotated[str | None, Query(min_length=1, max_length=ID_LENGTH)]
QueryName = Annotated[str | None, Query(max_length=NAME_LENGTH)]
Limit = Annotated[int, Query(ge=1, le=1000, description="Items per page.")]
Offset = Annotated[int, Query(ge=0, le=MAX_INT, description="Items to skip.")]
StepNumber = Annotated[int, Query(ge=0, le=MAX_INT, description="A trainer step number.")]
FilePath = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
# A host name (RFC 1123 labels) or an IPv4/IPv6 address, as a socket can be given it.
Host = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:-]+$")
]
DtypeName = Annotated[str, StringConstraints(min_length=1, max_length=32)]
Shape = Annotated[list[Count], Field(max_length=16)]
