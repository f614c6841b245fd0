"""Rendering sequences: stop trimming, stream hold-back, version spans, waiting-queue aborts."""

from __future__ import annotations

import pytest

from server.engine.responses import RenderOptions, StreamRenderer, final_output, output_text
from server.engine.sequence import GenerationParams, LogprobRequest, Sequence, State

# A toy decoder: token i is the character chr(ord("a") + i); 99 is "end", skipped as special.
END = 99


def decode(ids, skip_special_tokens=True):
    return "".join(
        "" if (i == END and skip_special_tokens) else "<end>" if i == END else chr(97 + i)
        for i in ids
    )


def make(params: GenerationParams | None = None, logprobs: bool = False) -> Sequence:
    return Sequence(
        rid="r",
        prompt_ids=[0, 1],
        params=params or GenerationParams(),
        logprobs=LogprobRequest(enabled=logprobs),
    )


def run(seq: Sequence, tokens: list[int], versions: list[str] | None = None) -> dict | None:
    """Append tokens until one finishes the sequence; its finish reason."""
    seq.state = State.RUNNING
    seq.ever_ran = True
    for i, token in enumerate(tokens):
        seq.append(token, -0.5, (versions or ["v0"] * len(tokens))[i])
        reason = seq.check_stop({END}, context_length=1000, decode=decode)
        if reason is not None:
            seq.finish(reason)
            return reason
    return None


def test_eos_is_kept_in_ids_and_trimmed_from_text():
    seq = make()
    assert run(seq, [7, 4, END, 3]) == {"type": "stop", "matched": END}
    out = final_output(seq, RenderOptions(decode=decode))
    assert out["output_ids"] == [7, 4, END]
    assert out["text"] == "he"


def test_no_stop_trim_keeps_the_stop_token_text():
    seq = make(GenerationParams(no_stop_trim=True, skip_special_tokens=False))
    run(seq, [7, END])
    assert output_text(seq, 2, decode) == "h<end>"


def test_ignore_eos_and_stop_token_ids():
    seq = make(GenerationParams(ignore_eos=True, stop_token_ids=frozenset({2}), max_new_tokens=9))
    assert run(seq, [1, END, 3, 2, 5]) == {"type": "stop", "matched": 2}
    assert seq.output_ids == [1, END, 3, 2]


def test_stop_string_across_tokens_is_trimmed():
    seq = make(GenerationParams(stop=("cd",)))
    assert run(seq, [0, 1, 2, 3, 4]) == {"type": "stop", "matched": "cd"}
    assert seq.output_ids == [0, 1, 2, 3]
    assert output_text(seq, 4, decode) == "ab"
    kept = make(GenerationParams(stop=("cd",), no_stop_trim=True))
    run(kept, [0, 1, 2, 3])
    assert output_text(kept, 4, decode) == "abcd"


def test_length_and_context_limits():
    seq = make(GenerationParams(max_new_tokens=3))
    assert run(seq, [1, 1, 1, 1]) == {"type": "length", "length": 3}
    tight = make(GenerationParams(max_new_tokens=100))
    tight.state = State.RUNNING
    tight.append(1, -1.0, "v")
    assert tight.check_stop(set(), context_length=3, decode=decode) == {
        "type": "length",
        "length": 1,
    }


def test_version_spans():
    seq = make(GenerationParams(max_new_tokens=5))
    run(seq, [1, 2, 3, 4, 5], ["a", "a", "b", "b", "c"])
    assert seq.weight_version_spans() == [
        {"version": "a", "start": 0, "end": 2},
        {"version": "b", "start": 2, "end": 4},
        {"version": "c", "start": 4, "end": 5},
    ]
    meta = final_output(seq, RenderOptions(decode=decode))["meta_info"]
    assert meta["weight_version"] == "c"
    assert meta["weight_versions"] == seq.weight_version_spans()


def test_stream_holds_back_a_possible_stop_prefix():
    seq = make(GenerationParams(stop=("cde",), max_new_tokens=10))
    renderer = StreamRenderer(seq, RenderOptions(decode=decode), incremental=True)
    seq.state = State.RUNNING
    emitted = []
    for token in [0, 1, 2, 3, 7, 8]:  # a b c d h i: "cd" could start "cde" until "h" arrives
        seq.append(token, -1.0, "v")
        chunk = renderer.chunk(len(seq.output_ids))
        emitted.append(None if chunk is None else chunk["text"])
    assert emitted == ["a", "b", None, None, "cdh", "i"]


def test_stream_holds_back_half_characters():
    def utf8_decode(ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    seq = make()
    seq.state = State.RUNNING
    renderer = StreamRenderer(seq, RenderOptions(decode=utf8_decode), incremental=False)
    texts = []
    for byte in "é!".encode():
        seq.append(byte, -1.0, "v")
        chunk = renderer.chunk(len(seq.output_ids))
        texts.append(None if chunk is None else chunk["text"])
    assert texts == [None, "é", "é!"]


def test_waiting_queue_abort_has_no_prompt_counts():
    seq = make(logprobs=True)
    seq.finish({"type": "abort", "message": "Abort in waiting queue"})
    meta = final_output(seq, RenderOptions(decode=decode))["meta_info"]
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    assert meta["weight_versions"] == []


@pytest.mark.parametrize("incremental", [True, False])
def test_final_chunk_carries_the_finish_reason(incremental):
    seq = make(GenerationParams(max_new_tokens=2))
    renderer = StreamRenderer(seq, RenderOptions(decode=decode, batch_index=3), incremental)
    run(seq, [1, 2])
    chunk = renderer.chunk(2)
    assert chunk["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert chunk["index"] == 3
