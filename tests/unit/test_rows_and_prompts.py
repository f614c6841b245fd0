"""Pure pieces of the proxy: row merging, prompt splicing, incremental decoding, packing."""

from __future__ import annotations

import random

import pytest

from server.proxy.prompts import from_ids, splice
from server.proxy.session_cache import LastTurn, last_turn
from server.store.packing import pack_floats, pack_ints, unpack_floats, unpack_ints
from server.store.rows import (
    PROMPT_VERSION,
    TurnTokens,
    assemble_rows,
    continues,
)
from server.text.detokenize import IncrementalDecoder
from server.text.tokenization import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def turn(
    cid, index, row, prompt, completion, versions=None, reward=None, extends=False
) -> TurnTokens:
    """Turn ``cid``, a request of its own, sampled at temperature 1."""
    return TurnTokens(
        completion_id=cid,
        request_id=f"req-{cid}",
        turn_index=index,
        row_index=row,
        extends_previous=extends,
        messages=None,
        tools=None,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5] * len(completion),
        versions=versions or [3] * len(completion),
        temperature=1.0,
        reward=reward,
    )


def test_continues_needs_an_exact_token_prefix():
    assert continues([1, 2], [3], [1, 2, 3, 4])
    assert not continues([1, 2], [3], [1, 2, 3])  # nothing new
    assert not continues([1, 2], [3], [1, 2, 4, 4])  # completion changed
    assert not continues([1, 2], [3], [9, 2, 3, 4])  # prompt changed


def test_assemble_rows_masks_prompts_and_keeps_turns():
    rows = assemble_rows(
        [
            turn("a", 0, 0, [1, 2], [3, 4], [0, 0]),
            turn("b", 1, 0, [1, 2, 3, 4, 5, 6], [7], [1], reward=0.5, extends=True),
            turn("c", 2, 1, [1, 2], [9], [1]),
        ]
    )
    first, second = rows
    assert first.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert first.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert first.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert first.versions == [PROMPT_VERSION] * 2 + [0, 0] + [PROMPT_VERSION] * 2 + [1]
    on_path = {"temperature": 1.0, "alternative": False, "finish_reason": None}
    assert first.turns == [
        {"completion_id": "a", "turn_index": 0, "start": 2, "end": 4, "reward": None, **on_path},
        {"completion_id": "b", "turn_index": 1, "start": 6, "end": 7, "reward": 0.5, **on_path},
    ]
    assert second.input_ids == [1, 2, 9] and second.loss_mask == [0, 0, 1]


def test_packing_round_trips():
    ids = [0, 1, 2**31 - 1, -(2**31), 688]
    assert unpack_ints(pack_ints(ids)) == ids
    assert len(pack_ints(ids)) == 4 * len(ids)
    floats = [0.0, -1.5, -23.25]
    assert unpack_floats(pack_floats(floats)) == floats
    assert unpack_ints(b"") == [] and unpack_ints(None) == []


def _chat(tokenizer, messages):
    return tokenizer.render(messages, add_generation_prompt=True)


def test_splice_reuses_the_sampled_tokens(tokenizer):
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt_ids = tokenizer.encode(_chat(tokenizer, first))
    # Sampled tokens that are not how the tokenizer would split the same text.
    sampled = [tokenizer.encode(c)[0] for c in "Four"] + tokenizer.encode("<|im_end|>")
    previous = last_turn(tokenizer, "c1", 0, prompt_ids, sampled)
    second = [*first, {"role": "assistant", "content": "Four"}, {"role": "user", "content": "ok"}]
    prompt = splice(tokenizer, _chat(tokenizer, second), [previous])
    assert prompt.continues == previous
    assert prompt.ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled
    assert tokenizer.decode(prompt.ids, skip_special_tokens=False) == _chat(tokenizer, second)


def test_splice_starts_over_when_history_changed(tokenizer):
    first = [{"role": "user", "content": "hi"}]
    previous = last_turn(tokenizer, "c1", 0, tokenizer.encode(_chat(tokenizer, first)), [5, 6])
    edited = [{"role": "user", "content": "hello"}]
    prompt = splice(tokenizer, _chat(tokenizer, edited), [previous])
    assert prompt.continues is None
    assert prompt.ids == tokenizer.encode(_chat(tokenizer, edited))


def test_from_ids_matches_on_tokens():
    previous = LastTurn("c", 0, [1, 2], [3], "")
    assert from_ids([1, 2, 3, 4], [previous]).continues == previous
    assert from_ids([1, 2, 4], [previous]).continues is None


def test_incremental_decoder_equals_full_decode(tokenizer):
    rng = random.Random(0)
    text = 'héllo wörld 日本語 🎉 <tool_call>{"a": 1}</tool_call> 12345 ok'
    ids = tokenizer.encode(text)
    for _ in range(20):
        decoder, out, position = IncrementalDecoder(tokenizer.decode), "", 0
        while position < len(ids):
            step = rng.randint(1, 3)
            out += decoder.push(ids[position : position + step])
            position += step
            assert "\ufffd" not in out
        out += decoder.flush()
        assert out == tokenizer.decode(ids) == text


def test_incremental_decoder_holds_half_characters(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level: the emoji spans several tokens
    decoder = IncrementalDecoder(tokenizer.decode)
    assert [decoder.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "🎉"
