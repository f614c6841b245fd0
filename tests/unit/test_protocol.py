"""Validation of /generate bodies into per-sample items."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from server.engine.protocol import EngineInputError, GenerateRequestIn, SamplingParamsIn, expand

counter = itertools.count()


def items(body: dict, context_length: int = 1000):
    request = GenerateRequestIn.model_validate(body)
    return expand(
        request,
        encode=lambda text: [ord(c) % 50 for c in text],
        vocab_size=50,
        context_length=context_length,
        new_rid=lambda: f"fresh-{next(counter)}",
    )


def test_single_request_defaults():
    (item,), batch = items({"input_ids": [1, 2, 3]})
    assert not batch
    assert item.prompt_ids == [1, 2, 3]
    assert item.params.max_new_tokens == 128
    assert item.params.sampling.temperature == 1.0
    assert not item.logprobs.enabled
    assert item.rid.startswith("fresh-")


def test_text_is_encoded():
    (item,), _ = items({"text": "abc", "rid": "t"})
    assert item.prompt_ids == [ord(c) % 50 for c in "abc"] and item.rid == "t"


def test_batches_take_per_item_values_and_suffix_rids():
    out, batch = items(
        {
            "input_ids": [[1], [2, 3]],
            "rid": "b",
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "return_logprob": [True, False],
        }
    )
    assert batch
    assert [i.rid for i in out] == ["b_0", "b_1"]
    assert [i.params.max_new_tokens for i in out] == [1, 2]
    assert [i.logprobs.enabled for i in out] == [True, False]


def test_n_gives_fresh_rids():
    out, batch = items({"input_ids": [1], "rid": "mine", "sampling_params": {"n": 3}})
    assert batch and len(out) == 3
    assert len({i.rid for i in out}) == 3 and "mine" not in {i.rid for i in out}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid has 1 entries"),
        ({"input_ids": [[1], []]}, "cannot be empty"),
        ({"text": []}, "empty list"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be"),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "non-negative"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"] * 33}}, "at most 32"),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "must not be empty"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [77]}}, "outside"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n must be"),
        ({"input_ids": [1], "session_params": {"id": "x"}}, "session_params is not supported"),
        ({"input_ids": [[1], [2]], "lora_path": ["x"]}, "lora_path has 1 entries"),
        ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 51}, "top_logprobs_num"),
        ({"input_ids": [1] * 900, "sampling_params": {"max_new_tokens": 200}}, "exceeds"),
    ],
)
def test_refusals(body, message):
    with pytest.raises(EngineInputError, match=message):
        items(body)


@pytest.mark.parametrize(
    "sampling",
    [{"bogus": 1}, {"max_new_tokens": "5"}, {"max_new_tokens": 1.5}, {"ignore_eos": 1}],
)
def test_schema_is_strict(sampling):
    with pytest.raises(ValidationError):
        GenerateRequestIn.model_validate({"input_ids": [1], "sampling_params": sampling})


def test_floats_accept_ints():
    params = SamplingParamsIn.model_validate({"temperature": 1, "top_p": 1}).to_params()
    assert params.sampling.temperature == 1.0
