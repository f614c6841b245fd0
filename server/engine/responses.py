"""Render a :class:`Sequence` as SGLang's ``/generate`` output (section 1.3 of the reference).

``final_output`` is the non-streaming answer. A :class:`StreamRenderer` turns progress into SSE
chunks: cumulative by default (each chunk holds everything so far) or deltas with
``--incremental-streaming-output``. A chunk is held back while the text might end in the start
of a stop string or in half a UTF-8 character; the next chunk then carries it. This module knows
nothing about the scheduler or the model beyond a ``decode`` function.
"""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.sequence import Sequence
from server.text.stop_strings import held_back

Decode = Callable[..., str]  # decode(ids, skip_special_tokens=...) -> str


@dataclass(frozen=True)
class RenderOptions:
    decode: Decode
    return_prompt_token_ids: bool = False
    batch_index: int | None = None  # set on streamed batches: the chunk's "index"


def output_text(seq: Sequence, n: int, decode: Decode) -> str:
    """The text of the first ``n`` output tokens, with a matched stop trimmed once finished."""
    ids = seq.output_ids[:n]
    final = seq.finished and n == len(seq.output_ids)
    trim = final and not seq.params.no_stop_trim
    if trim and seq.matched_stop_token:
        ids = ids[:-1]
    text = decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
    if trim and seq.matched_stop_text is not None:
        cut = text.find(seq.matched_stop_text)
        if cut >= 0:
            text = text[:cut]
    return text


def _must_wait(text: str, stops: tuple[str, ...]) -> bool:
    """Half a character at the end, or the start of a stop string."""
    return text.endswith("\ufffd") or held_back(text, stops) > 0


def _logprob_entries(
    values: abc.Sequence[float | None], ids: list[int], with_text: bool, decode: Decode
) -> list[list]:
    return [
        [lp, token, decode([token]) if with_text else None]
        for lp, token in zip(values, ids, strict=True)
    ]


def _top_entries(
    positions: abc.Sequence[list[tuple[float, int]] | None], with_text: bool, decode: Decode
) -> list[list[list] | None]:
    out: list[list[list] | None] = []
    for pairs in positions:
        if pairs is None:
            out.append(None)
        else:
            lps, ids = [p[0] for p in pairs], [p[1] for p in pairs]
            out.append(_logprob_entries(lps, ids, with_text, decode))
    return out


def meta_info(
    seq: Sequence, n: int, decode: Decode, start: int = 0, with_input: bool = True
) -> dict:
    """``meta_info`` for output tokens ``[start, n)`` (``start`` > 0 for incremental chunks)."""
    final = seq.finished and n == len(seq.output_ids)
    meta: dict = {"id": seq.rid, "finish_reason": seq.finish_reason if final else None}
    if seq.ever_ran:  # a request aborted in the waiting queue reports no prompt counts
        meta.update(prompt_tokens=len(seq.prompt_ids), cached_tokens=0)
    meta.update(
        completion_tokens=n,
        reasoning_tokens=0,
        num_retractions=seq.num_retractions,
        weight_version=seq.versions[n - 1] if n else seq.version_at_submit,
    )
    if final:
        meta["weight_versions"] = seq.weight_version_spans()
    request = seq.logprobs
    if request.enabled:
        text = request.with_text
        prompt_ids = seq.prompt_ids[max(request.start_len, 0) :]
        if with_input:
            meta["input_token_logprobs"] = _logprob_entries(
                seq.input_logprobs, prompt_ids[: len(seq.input_logprobs)], text, decode
            )
        meta["output_token_logprobs"] = _logprob_entries(
            seq.output_logprobs[start:n], seq.output_ids[start:n], text, decode
        )
        meta["output_token_logprobs_length"] = n - start
        if request.top_k > 0:
            if with_input:
                meta["input_top_logprobs"] = _top_entries(seq.input_top, text, decode)
            meta["output_top_logprobs"] = _top_entries(seq.output_top[start:n], text, decode)
        if request.token_ids:
            if with_input:
                meta["input_token_ids_logprobs"] = _top_entries(
                    seq.input_token_ids_lp, text, decode
                )
            meta["output_token_ids_logprobs"] = _top_entries(
                seq.output_token_ids_lp[start:n], text, decode
            )
    if final and seq.finished_at is not None:
        meta["e2e_latency"] = seq.finished_at - seq.created
    meta["response_sent_to_client_ts"] = time.time()
    return meta


def final_output(seq: Sequence, options: RenderOptions) -> dict:
    n = len(seq.output_ids)
    out = {
        "text": output_text(seq, n, options.decode),
        "output_ids": list(seq.output_ids),
        "meta_info": meta_info(seq, n, options.decode),
    }
    if options.return_prompt_token_ids:
        out["prompt_token_ids"] = list(seq.prompt_ids)
    return out


class StreamRenderer:
    """Chunks of one streamed sequence; remembers what it already sent."""

    def __init__(self, seq: Sequence, options: RenderOptions, incremental: bool) -> None:
        self.seq = seq
        self.options = options
        self.incremental = incremental
        self.sent_tokens = 0
        self.sent_text = 0
        self.sent_any = False

    def chunk(self, n: int) -> dict | None:
        """The chunk for the first ``n`` tokens, or None while it must wait."""
        seq, decode = self.seq, self.options.decode
        final = seq.finished and n == len(seq.output_ids)
        text = output_text(seq, n, decode)
        if not final and _must_wait(text, seq.params.stop):
            return None
        out: dict[str, Any]
        if self.incremental:
            out = {
                "text": text[self.sent_text :],
                "output_ids": seq.output_ids[self.sent_tokens : n],
                "meta_info": meta_info(
                    seq, n, decode, start=self.sent_tokens, with_input=not self.sent_any
                ),
            }
        else:
            out = {
                "text": text,
                "output_ids": seq.output_ids[:n],
                "meta_info": meta_info(seq, n, decode),
            }
        if self.options.return_prompt_token_ids and not self.sent_any:
            out["prompt_token_ids"] = list(seq.prompt_ids)
        if self.options.batch_index is not None:
            out["index"] = self.options.batch_index
        self.sent_tokens, self.sent_text, self.sent_any = n, len(text), True
        return out
