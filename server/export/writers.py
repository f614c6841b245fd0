"""Export writers: records in, a page at a time; bytes out, ready to write or to send.

One writer per format in ``FORMATS``. Each turns a page of records into the bytes that page
adds to the file (:meth:`Writer.page`) and gives the file's last bytes at :meth:`Writer.close`;
it never holds more than one page. JSONL is a line per record. Parquet is one row group per
page, written to an in-memory sink that is emptied after every page: the file streams out as it
is written (a Parquet file is written front to back; only its footer waits for the end), with
no temporary file. Parquet needs pyarrow (the ``export`` extra); JSONL needs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from server.common import one_line_json
from server.errors import InvalidRequest
from server.export.schema import arrow_schema

PARQUET_UNAVAILABLE = (
    "Parquet export needs pyarrow, which is not installed here: pip install 'proxrl[export]', "
    "or export as jsonl."
)


class Writer(Protocol):
    media_type: str

    def page(self, records: list[dict[str, Any]]) -> bytes: ...

    def close(self) -> bytes: ...


class JsonlWriter:
    """A line of JSON per record (JSON Lines; UTF-8, with U+2028, U+2029 and U+0085 escaped so
    that no reader sees a line end inside a record)."""

    media_type = "application/x-ndjson"

    def page(self, records: list[dict[str, Any]]) -> bytes:
        return b"".join(
            one_line_json.dumps(record, separators=(",", ":")).encode() + b"\n"
            for record in records
        )

    def close(self) -> bytes:
        return b""


class _Sink:
    """A write-only file that hands over what was written since it was last emptied."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._position = 0
        self.closed = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._position += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class ParquetWriter:
    """A Parquet file, a row group per page, zstd-compressed."""

    media_type = "application/vnd.apache.parquet"

    def __init__(self) -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise InvalidRequest(
                PARQUET_UNAVAILABLE, param="format", code="parquet_unavailable"
            ) from None
        self._table = pa.Table.from_pylist
        self._schema = arrow_schema()
        self._sink = _Sink()
        self._writer = pq.ParquetWriter(self._sink, self._schema, compression="zstd")

    def page(self, records: list[dict[str, Any]]) -> bytes:
        if records:
            self._writer.write_table(self._table(records, schema=self._schema))
        return self._sink.take()

    def close(self) -> bytes:
        self._writer.close()
        return self._sink.take()


FORMATS: dict[str, Callable[[], Writer]] = {"jsonl": JsonlWriter, "parquet": ParquetWriter}
