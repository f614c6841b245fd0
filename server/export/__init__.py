"""Trajectory files: the export record's schema (``schema``) and its JSONL and Parquet writers
(``writers``). Records come in as plain dicts, bytes go out; this package knows nothing of the
store, HTTP or how a record is built from a session (``server.rl.export`` does that)."""
