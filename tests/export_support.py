"""What the export tests share: a record held field by field to GET /rl/sessions/{id}."""

from __future__ import annotations

import json
from datetime import datetime

from server.export.schema import names


def time_of(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _masks(view: dict) -> dict[str, list[int]]:
    """Per turn, the completion tokens the trainer trains: its row's loss mask over it, none of
    an alternative without a reward of its own."""
    masks = {}
    for row in view["rows"]:
        for turn in row["turns"]:
            mask = row["loss_mask"][turn["start"] : turn["end"]]
            masks[turn["completion_id"]] = (
                [0] * len(mask) if (turn["alternative"] and turn["reward"] is None) else mask
            )
    return masks


def assert_record_is_the_session(record: dict, view: dict) -> None:
    """Every field of the record against GET /rl/sessions/{id}."""
    assert list(record) == names()
    plain = "session_id run_id task_id group_id eval status drop_reason turn_count row_count "
    plain += "conversations breaks retries reward"
    for name in plain.split():
        assert record[name] == view[name], name
    assert json.loads(record["metadata_json"]) == view["metadata"]
    assert time_of(record["created_at"]) == time_of(view["created_at"])
    ended = record["ended_at"]
    assert (ended and time_of(ended)) == (view["ended_at"] and time_of(view["ended_at"]))
    assert {r["target"]: r["reward"] for r in record["rewards"]} == view["rewards"]
    assert len(record["rewards"]) == len(view["rewards"])
    masks = _masks(view)
    alternatives = {t["completion_id"]: t["alternative"] for r in view["rows"] for t in r["turns"]}
    assert len(record["turns"]) == len(view["turns"])
    for got, want in zip(record["turns"], view["turns"], strict=True):
        exact = "completion_id request_id turn_index row_index conversation surface model "
        exact += "finish_reason "
        exact += "extends_previous prompt_ids completion_ids logprobs versions reward engine "
        exact += "resubmits"
        for name in exact.split():
            assert got[name] == want[name], name
        for name in ("messages", "tools", "response", "sampling"):
            assert json.loads(got[f"{name}_json"]) == want[name], name
        assert time_of(got["created_at"]) == time_of(want["created_at"])
        assert got["alternative"] == alternatives[want["completion_id"]]
        assert got["loss_mask"] == masks[want["completion_id"]]
        assert len(got["loss_mask"]) == len(want["completion_ids"])
    assert record["rows"] == view["rows"]
