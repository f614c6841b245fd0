"""Reasoning on the Responses API, for real (the warmed-up reasoning model of
test_reasoning_rows.py): 5-turn conversations through the openai SDK keep one exact row, chained
by ``previous_response_id`` or resent whole with the output items the client got (reasoning
items included, as the Agents SDK sends them); the reasoning is a reasoning item, the answer
the message."""

from __future__ import annotations

import pytest
from openai import OpenAI

from server.proxy.reasoning import ReasoningStyle, split_reasoning
from server.text.tokenization import Tokenizer
from tests.integration.test_reasoning_rows import QUESTIONS, proxy, reasoning_model

pytestmark = pytest.mark.slow
__all__ = ["proxy", "reasoning_model"]  # the fixtures, shared with test_reasoning_rows.py


def ask(client: OpenAI, turn: int, **body) -> dict:
    """One response (streamed on odd turns), as the JSON the client got; at temperature 0.5,
    where the warmed-up model nearly always reasons first."""
    body = {"model": "gpt-5.6-luna", "max_output_tokens": 40, "temperature": 0.5, **body}
    if turn % 2 == 0:
        return client.responses.create(**body).model_dump(mode="json", exclude_none=True)
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        return stream.get_final_response().model_dump(mode="json", exclude_none=True)


def check_one_exact_row(proxy, session: dict, served: list[dict], tokenizer: Tokenizer) -> None:
    view = proxy.get_session(session["session_id"])
    assert view["breaks"] == 0 and view["row_count"] == 1
    turns, (row,) = view["turns"], view["rows"]
    assert [t["extends_previous"] for t in turns] == [False, True, True, True, True]
    with_reasoning = 0
    for turn, response, span in zip(turns, served, row["turns"], strict=True):
        assert row["input_ids"][: span["start"]] == turn["prompt_ids"]
        assert row["input_ids"][span["start"] : span["end"]] == turn["completion_ids"]
        assert turn["response"]["output"] == response["output"]
        reasoning, content = split_reasoning(
            tokenizer.decode(turn["completion_ids"]), ReasoningStyle(True, False)
        )
        kinds = {item["type"]: item for item in response["output"]}
        assert kinds["message"]["content"][0]["text"] == content
        if reasoning:
            with_reasoning += 1
            assert kinds["reasoning"]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert with_reasoning >= 3


def test_five_chained_responses_keep_one_exact_row(proxy, reasoning_model):
    session = proxy.session()
    served, previous = [], None
    with OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        for turn, question in enumerate(QUESTIONS):
            response = ask(client, turn, input=question, previous_response_id=previous)
            served.append(response)
            previous = response["id"]
    check_one_exact_row(proxy, session, served, Tokenizer.from_pretrained(reasoning_model))


def test_five_responses_resent_whole_with_their_items_keep_one_exact_row(proxy, reasoning_model):
    session = proxy.session()
    served, items = [], []
    with OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        for turn, question in enumerate(QUESTIONS):
            items.append({"role": "user", "content": question})
            response = ask(client, turn, input=items, store=False)
            served.append(response)
            items += response["output"]  # reasoning items too, as the Agents SDK sends them
    check_one_exact_row(proxy, session, served, Tokenizer.from_pretrained(reasoning_model))
