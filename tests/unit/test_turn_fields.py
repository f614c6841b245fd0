"""A turn's fields are listed once (``server.store.turns.TurnFields``): the turns table stores a
record's fields and what the write derives, a stored turn reads back as the fields it was written
with, and the REST answer is those fields, the turn's reward and when it was served."""

from __future__ import annotations

from dataclasses import asdict, fields

from server.rl.schemas import TurnOut
from server.store import turns
from server.store.tables import Turn
from server.store.turns import TurnFields, TurnRecord

DERIVED = {"id", "prompt_tokens", "completion_tokens", "created_at"}  # the store's own
COUNTED = {
    "new_row",
    "is_break",
    "new_conversation",
}  # they bump the session's counters; no column of their own


def names(cls: type) -> list[str]:
    return [field.name for field in fields(cls)]


def record() -> TurnRecord:
    return TurnRecord(
        session_id="s",
        run_id="r",
        completion_id="chatcmpl-1",
        request_id="chatcmpl-1",
        surface="chat",
        model="gpt-4o-mini",
        turn_index=1,
        row_index=0,
        extends_previous=True,
        conversation=1,
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        response={"role": "assistant", "content": "ok"},
        prompt_ids=[5, 6, 7],
        completion_ids=[8, 2],
        logprobs=[-0.25, -1.5],  # exact in float32, as they are stored
        versions=[3, 4],
        finish_reason="stop",
        sampling={"temperature": 1.0},
        engine="http://127.0.0.1:30000",
        resubmits=1,
    )


def test_the_turns_table_stores_every_field_of_a_record():
    assert set(Turn.__table__.columns.keys()) == (set(names(TurnRecord)) - COUNTED) | DERIVED


def test_a_stored_turn_reads_back_as_the_fields_it_was_written_with():
    written = record()
    (row,) = turns._turn_rows([written])
    assert row["prompt_tokens"] == 3 and row["completion_tokens"] == 2
    expected = {name: value for name, value in asdict(written).items() if name in names(TurnFields)}
    assert turns.served_fields(Turn(**row)) == expected


def test_the_rest_answer_is_the_fields_a_reward_and_a_time():
    assert names(TurnOut) == [*names(TurnFields), "reward", "created_at"]
