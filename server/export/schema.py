"""The export record: one line (JSONL) or one Parquet row per session, with its turns and rows.

Written once here, as a table of columns: the Parquet schema (:func:`arrow_schema`), the
``datasets`` features (:func:`features`) and the docs' table (:func:`markdown_table`) are all
read from it, and a test holds the records ``server.rl.export`` builds to it.

Every column has one fixed type, so Arrow never has to guess. Free-form values (messages, tools,
a response, sampling settings, metadata: a message's content is a string in one message and a
list of parts in another, tool arguments and response fields vary) are JSON text in columns named
``*_json``; ``json.loads`` gives them back exactly as GET /rl/sessions/{id} shows them. Integers
are int64, floats float64 (a logprob is the stored float32, exactly), times ISO-8601 UTC text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["string", "int", "float", "bool", "json", "ints", "floats", "records"]


@dataclass(frozen=True)
class Column:
    name: str
    kind: Kind
    doc: str
    nullable: bool = False
    fields: tuple[Column, ...] = ()  # a "records" column: the fields of each record


REWARD = (
    Column("target", "string", '"session", or the completion_id of the rewarded turn.'),
    Column("reward", "float", "The reward posted for it."),
)

ROW_TURN = (
    Column("completion_id", "string", "The turn."),
    Column("turn_index", "int", "Its turn_index."),
    Column("start", "int", "Its sampled tokens are input_ids[start:end]."),
    Column("end", "int", "See start."),
    Column("reward", "float", "Its own reward (null: none).", nullable=True),
    Column("temperature", "float", "What it was sampled at (null: unknown).", nullable=True),
    Column("alternative", "bool", "The session did not go on from it (a retry, another choice)."),
    Column(
        "finish_reason",
        "string",
        "Why its answer ended: length when the length limit cut it, else stop or tool_calls.",
    ),
)

TURN = (
    Column("completion_id", "string", "The completion's id (a Responses API response id)."),
    Column("request_id", "string", "Shared by the choices of one request (n > 1)."),
    Column("turn_index", "int", "Its order in the session, from 0."),
    Column("row_index", "int", "The training row it belongs to (rows[].row_index)."),
    Column(
        "conversation",
        "int",
        "The session's conversation it belongs to, from 0 in order of first request "
        "(the agent's main thread, a title or summary request, a sub-agent...).",
    ),
    Column("surface", "string", "The API it came through: chat, completions, responses, messages."),
    Column("model", "string", "The model name the request asked for.", nullable=True),
    Column("finish_reason", "string", "Why sampling stopped: stop, length, tool_calls, ..."),
    Column("extends_previous", "bool", "It continues the previous request's turn in its row."),
    Column("alternative", "bool", "The session did not go on from it (a retry, another choice)."),
    Column("prompt_ids", "ints", "The prompt's token ids, exactly as the engine saw them."),
    Column("completion_ids", "ints", "The sampled token ids."),
    Column("logprobs", "floats", "The behaviour logprob of each sampled token."),
    Column("versions", "ints", "The policy version that sampled each token."),
    Column(
        "loss_mask",
        "ints",
        "Per sampled token, 1 where the trainer trains it: its row's loss mask over the turn "
        "(1 on sampled tokens), 0 throughout for an alternative without a reward of its own. "
        "The trainer's own masks (tokens too stale, another temperature) depend on its config "
        "and are not applied.",
    ),
    Column("reward", "float", "Its own reward (null: none).", nullable=True),
    Column(
        "messages_json",
        "json",
        "Its request's conversation in its API's own form (`null`: a text prompt).",
    ),
    Column("tools_json", "json", "The tools its request offered (`null`: none)."),
    Column("response_json", "json", "The answer as the API returned it."),
    Column("sampling_json", "json", "Its sampling settings (temperature, top_p, max_tokens...)."),
    Column("engine", "string", "The engine that served it.", nullable=True),
    Column("resubmits", "int", "Times it was sent to an engine again after a failure."),
    Column("created_at", "string", "When it was served (ISO-8601, UTC)."),
)

ROW = (
    Column("row_index", "int", "The row's index in the session."),
    Column("input_ids", "ints", "The row's tokens: prompts and completions, merged."),
    Column("loss_mask", "ints", "1 on tokens the model sampled, 0 on the rest."),
    Column("logprobs", "floats", "Behaviour logprobs (0.0 on prompt tokens)."),
    Column("versions", "ints", "Policy version per token (-1 on prompt tokens)."),
    Column("turns", "records", "The turns in the row, in order.", fields=ROW_TURN),
)

SESSION = (
    Column("session_id", "string", "The session."),
    Column("run_id", "string", "Its run."),
    Column("task_id", "string", "Its task.", nullable=True),
    Column("group_id", "string", "Its GRPO group.", nullable=True),
    Column("eval", "bool", "An evaluation session (never trained)."),
    Column("production", "bool", "A production session (served, never trained)."),
    Column(
        "status", "string", "open, ended, trainable, claimed, consumed, dropped, evaluated, served."
    ),
    Column("drop_reason", "string", "Why it was dropped (null unless dropped).", nullable=True),
    Column("metadata_json", "json", "The metadata it was created with (a JSON object)."),
    Column("created_at", "string", "When it was created (ISO-8601, UTC)."),
    Column("ended_at", "string", "When it ended (ISO-8601, UTC; null: open).", nullable=True),
    Column("turn_count", "int", "Its turns."),
    Column("row_count", "int", "Its training rows."),
    Column(
        "conversations",
        "int",
        "Its conversations: the agent's main thread and each request that continued none of "
        "the session's conversations (a title or summary request, a sub-agent, a compacted "
        "history). Each opened a row.",
    ),
    Column(
        "breaks",
        "int",
        "Requests that changed a conversation's recorded history (each opened a row).",
    ),
    Column("retries", "int", "Requests sent again whose answer the session did not go on from."),
    Column("reward", "float", "Its session reward (null: none).", nullable=True),
    Column("rewards", "records", "Every reward posted, by target.", fields=REWARD),
    Column("turns", "records", "Its turns, by turn_index.", fields=TURN),
    Column("rows", "records", "Its training rows, as a claim gives them.", fields=ROW),
)


def names(columns: tuple[Column, ...] = SESSION) -> list[str]:
    return [column.name for column in columns]


def _arrow_type(column: Column) -> Any:
    import pyarrow as pa

    scalar = {
        "string": pa.string(),
        "json": pa.string(),
        "int": pa.int64(),
        "float": pa.float64(),
        "bool": pa.bool_(),
        "ints": pa.list_(pa.int64()),
        "floats": pa.list_(pa.float64()),
    }
    if column.kind == "records":
        return pa.list_(pa.struct([_arrow_field(field) for field in column.fields]))
    return scalar[column.kind]


def _arrow_field(column: Column) -> Any:
    import pyarrow as pa

    return pa.field(column.name, _arrow_type(column), nullable=column.nullable)


def arrow_schema() -> Any:
    """The record as a ``pyarrow.Schema`` (needs pyarrow: the ``export`` extra)."""
    import pyarrow as pa

    return pa.schema([_arrow_field(column) for column in SESSION])


def features() -> Any:
    """The record as ``datasets.Features``: give them to ``load_dataset("json", ...,
    features=...)`` for a JSONL export over 10 MB whose first 10 MB hold no value in a nullable
    column (``datasets`` fixes a JSON file's types from its first chunk)."""
    from datasets import Features

    return Features.from_arrow_schema(arrow_schema())


_KIND_NAMES = {
    "string": "string",
    "json": "string (JSON text)",
    "int": "int64",
    "float": "float64",
    "bool": "bool",
    "ints": "list of int64",
    "floats": "list of float64",
    "records": "list of records",
}


def markdown_table(columns: tuple[Column, ...] = SESSION, prefix: str = "") -> list[str]:
    """The record as docs/architecture/export.md tables it; nested columns as ``turns[].model``."""
    lines = [] if prefix else ["| column | type | meaning |", "|---|---|---|"]
    for column in columns:
        kind = _KIND_NAMES[column.kind] + (" or null" if column.nullable else "")
        lines.append(f"| `{prefix}{column.name}` | {kind} | {column.doc} |")
        if column.fields:
            lines += markdown_table(column.fields, f"{prefix}{column.name}[].")
    return lines
