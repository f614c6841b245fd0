"""One session, every surface: a turn on any surface whose prompt continues the previous turn
token for token continues its training row, whatever surface that turn came in on."""

from __future__ import annotations

import itertools

from tests.api.api_support import Api

MODEL = "tiny"


def test_chat_then_messages_then_responses_continue_one_row(api: Api):
    session = api.new_session(task_id="mixed")
    key = session["api_key"]
    question = {"role": "user", "content": "What is 2 + 3?"}
    chat = api.chat(session, question["content"], max_tokens=6, seed=3)
    answer = chat["choices"][0]["message"]["content"]

    # Anthropic Messages, the history as Claude's clients send it: the answer as a text block.
    follow = "And 4 + 5?"
    body = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 6,
        "messages": [
            question,
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": follow},
        ],
    }
    message = api.ok("POST", "/v1/messages", key=key, json=body)
    second = "".join(block["text"] for block in message["content"] if block["type"] == "text")

    # The Responses API, the whole history as input items.
    items = [
        question,
        {"role": "assistant", "content": [{"type": "output_text", "text": answer}]},
        {"role": "user", "content": follow},
        {"role": "assistant", "content": [{"type": "output_text", "text": second}]},
        {"role": "user", "content": "Thanks."},
    ]
    body = {"model": "gpt-4o-mini", "input": items, "max_output_tokens": 6}
    api.ok("POST", "/v1/responses", key=key, json=body)

    view = api.session(session["session_id"])
    turns = view["turns"]
    assert [t["surface"] for t in turns] == ["chat", "messages", "responses"]
    assert [t["model"] for t in turns] == [MODEL, "claude-sonnet-4-6", "gpt-4o-mini"]
    assert [t["row_index"] for t in turns] == [0, 0, 0] and view["breaks"] == 0
    for earlier, later in itertools.pairwise(turns):
        assert later["extends_previous"]
        sampled = earlier["prompt_ids"] + earlier["completion_ids"]
        assert later["prompt_ids"][: len(sampled)] == sampled  # token for token
    (row,) = view["rows"]
    assert row["input_ids"][: len(turns[-1]["prompt_ids"])] == turns[-1]["prompt_ids"]
