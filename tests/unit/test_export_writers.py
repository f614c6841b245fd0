"""The export writers and options, pure: JSONL a line per record, Parquet a row group per page
handed out as it is written, the ``--since`` forms, and the error when pyarrow is missing."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest
from pydantic import TypeAdapter, ValidationError

from server.export.options import Since, since_time
from server.export.schema import SESSION, arrow_schema, markdown_table, names
from server.export.writers import FORMATS, JsonlWriter, ParquetWriter
from tests.support import ROOT


def record(index: int, reward: float | None = None) -> dict:
    """A record of the schema, every column filled with a value of its type."""
    values = {"string": f"s{index}", "json": json.dumps({"i": index}), "int": index,
              "float": 0.5, "bool": True, "ints": [index, 1], "floats": [-0.25]}  # fmt: skip

    def fill(columns) -> dict:
        return {
            c.name: [fill(c.fields)] if c.kind == "records" else values[c.kind] for c in columns
        }

    filled = fill(SESSION)
    filled["reward"] = reward
    return filled


def test_jsonl_is_a_line_per_record_and_nothing_at_the_end():
    writer = JsonlWriter()
    data = writer.page([record(0), record(1, 1.0)]) + writer.page([]) + writer.close()
    lines = data.decode().splitlines()
    assert [json.loads(line) for line in lines] == [record(0), record(1, 1.0)]
    assert list(json.loads(lines[0])) == names()


def test_parquet_hands_out_each_page_as_it_is_written():
    writer = ParquetWriter()
    chunks = [writer.page([record(i) for i in range(3)]), writer.page([record(3, -1.0)])]
    assert all(chunks)  # each page's bytes come out at once, not at the end
    chunks.append(writer.close())
    data = b"".join(chunks)
    assert data[:4] == b"PAR1" and data[-4:] == b"PAR1"
    parquet = pq.ParquetFile(io.BytesIO(data))
    assert parquet.metadata.num_row_groups == 2  # a row group per page
    assert parquet.schema_arrow.equals(arrow_schema())
    assert parquet.read().to_pylist() == [*(record(i) for i in range(3)), record(3, -1.0)]


def test_a_record_off_the_schema_is_refused():
    bad = record(0)
    bad["turn_count"] = "three"
    with pytest.raises(Exception, match="int"):
        ParquetWriter().page([bad])


def test_since_takes_iso_times_and_durations():
    now = datetime.now(UTC)
    assert since_time("2026-11-24T09:00:00Z") == datetime(2026, 11, 24, 9, tzinfo=UTC)
    assert since_time("2026-11-24T09:00:00") == datetime(2026, 11, 24, 9, tzinfo=UTC)
    assert since_time(datetime(2026, 11, 24, 9)) == datetime(2026, 11, 24, 9, tzinfo=UTC)
    offset = since_time("2026-11-24T10:00:00+01:00")
    assert offset == datetime(2026, 11, 24, 9, tzinfo=UTC) and offset.tzinfo is UTC
    for text, back in [("90s", 90), ("30m", 1800), ("2h", 7200), ("7d", 604800), ("1w", 604800)]:
        assert abs(since_time(text) - (now - timedelta(seconds=back))) < timedelta(seconds=5)
    for text in ["yesterday", "2h ago", "-1h", "", "99999999999999w", "1" * 65 + "s"]:
        with pytest.raises(ValidationError):
            TypeAdapter(Since).validate_python(text)
    # a time whose offset moves it past year 1 or 9999 in UTC: refused (a 422), never a 500
    for text in ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"]:
        with pytest.raises(ValidationError, match="UTC"):
            TypeAdapter(Since).validate_python(text)


def test_every_format_is_a_writer():
    assert set(FORMATS) == {"jsonl", "parquet"}
    for make in FORMATS.values():
        writer = make()
        assert writer.media_type and writer.close() is not None


def test_parquet_without_pyarrow_says_what_to_install():
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
        "from server.errors import InvalidRequest\n"
        "from server.export.writers import ParquetWriter\n"
        "try:\n    ParquetWriter()\nexcept InvalidRequest as exc:\n"
        "    print(exc.code, exc.param, exc.message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("parquet_unavailable format ")
    assert "pip install 'proxrl[export]'" in done.stdout


def test_the_docs_carry_the_schema_as_written():
    """The export page's table (docs/architecture/export.md) is ``markdown_table()``, line for
    line, in one block."""
    page = (ROOT / "docs" / "architecture" / "export.md").read_text()
    table = "\n".join(markdown_table())
    assert table + "\n" in page
