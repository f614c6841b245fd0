"""What chat and text completions share: a completion's final text, its streamed text, its
logprobs in OpenAI's shape, and usage counts.

The text is always decoded by the proxy from the sampled token ids (never taken from the
engine), a matched stop string or stop token is cut from it, and while streaming, text that may
be the start of a stop string is held back until it is clear.
"""

from __future__ import annotations

from server.proxy.generation import Completion
from server.text.detokenize import IncrementalDecoder
from server.text.stop_strings import held_back
from server.text.tokenization import Tokenizer


def final_text(tokenizer: Tokenizer, completion: Completion) -> str:
    ids = completion.ids
    matched = completion.finish_reason.get("matched")
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def finish_reason(completion: Completion, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if completion.finish_reason.get("type") == "length" else "stop"


class TextStreamer:
    """Streamed text of one completion: deltas safe to send, and the rest at the end."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._decoder = IncrementalDecoder(tokenizer.decode)
        self._stops = stops
        self._pending = ""

    def push(self, ids: list[int]) -> str:
        self._pending += self._decoder.push(ids)
        found = [self._pending.find(stop) for stop in self._stops if stop in self._pending]
        if found:  # a whole stop string: nothing from it on is ever sent
            ready = self._pending[: min(found)]
        else:
            ready = self._pending[: len(self._pending) - held_back(self._pending, self._stops)]
        self._pending = self._pending[len(ready) :]
        return ready

    def finish(self, completion: Completion) -> str:
        matched = completion.finish_reason.get("matched")
        rest = self._pending + self._decoder.flush()
        self._pending = ""
        if isinstance(matched, str) and matched in rest:
            rest = rest[: rest.find(matched)]
        return rest


def logprob_entry(
    tokenizer: Tokenizer, token: int, logprob: float, top: list[tuple[float, int]] | None
) -> dict:
    """One token of OpenAI's chat ``logprobs.content``."""
    text = tokenizer.token_text(token)
    entry: dict = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    entry["top_logprobs"] = [
        {"token": t, "logprob": lp, "bytes": list(t.encode())}
        for lp, t in ((lp, tokenizer.token_text(tid)) for lp, tid in (top or []))
    ]
    return entry


def usage(prompt_tokens: int, completions: list[Completion]) -> dict:
    completion_tokens = sum(len(c.ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
