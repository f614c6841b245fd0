"""One generation request as the scheduler sees it: its prompt, its settings, and what it sampled.

A :class:`Sequence` records every sampled token with its logprob and the weight version that
produced it, and decides when it is finished (a stop token, a stop string, its length budget or
the context). The scheduler thread is its only writer; readers on the HTTP side look at
``output_ids[:n]`` and friends for an ``n`` the scheduler handed them, which stays valid because
the lists only ever grow. This module knows nothing about HTTP or the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from server.engine.lora import Adapter
from server.engine.sampling import RowSampling

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class GenerationParams:
    """Validated ``sampling_params`` of one request."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: RowSampling = field(default_factory=RowSampling)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int | None = None


@dataclass(frozen=True)
class LogprobRequest:
    """Which logprobs a request asked for (all off unless ``return_logprob``)."""

    enabled: bool = False
    start_len: int = -1  # -1: output tokens only; k: prompt positions k.. as well
    top_k: int = 0
    token_ids: tuple[int, ...] = ()
    with_text: bool = False

    @property
    def wants_input(self) -> bool:
        return self.enabled and self.start_len >= 0


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


Listener = Callable[[int, bool], None]  # (tokens available, finished)


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: GenerationParams
    logprobs: LogprobRequest = LogprobRequest()
    stream: bool = False
    listener: Listener | None = None
    internal: bool = False  # health checks: not counted as load
    adapter: Adapter | None = None  # its LoRA adapter (held until it ends); None: the base

    state: State = State.WAITING
    slot: int | None = None
    kv_len: int = 0
    kv_epoch: int = -1  # the scheduler's weights epoch at its last prefill (prefix cache)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_lp: list[list[tuple[float, int]]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_lp: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish_reason: dict | None = None
    matched_stop_token: bool = False  # finished on a stop/EOS token (trimmed from text)
    matched_stop_text: str | None = None
    ever_ran: bool = False
    num_retractions: int = 0
    version_at_submit: str = "default"
    created: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    generator: torch.Generator | None = None  # set when params.sampling_seed is
    _since_notify: int = 0

    def __post_init__(self) -> None:
        if self.params.sampling_seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.sampling_seed)

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def append(
        self,
        token: int,
        logprob: float,
        version: str,
        top: list[tuple[float, int]] | None = None,
        token_ids_lp: list[tuple[float, int]] | None = None,
    ) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.output_top.append(top)
        if token_ids_lp is not None:
            self.output_token_ids_lp.append(token_ids_lp)

    # ----- finishing ------------------------------------------------------------------------

    def check_stop(
        self, eos_ids: set[int], context_length: int, decode: Callable[[list[int]], str]
    ) -> dict | None:
        """The finish reason the last sampled token causes, if any."""
        token = self.output_ids[-1]
        params = self.params
        if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
            self.matched_stop_token = True
            return {"type": "stop", "matched": token}
        if params.stop:
            tail = decode(self.output_ids[-_tail_tokens(params.stop) :])
            for stop in params.stop:
                if stop in tail:
                    self.matched_stop_text = stop
                    return {"type": "stop", "matched": stop}
        if len(self.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if len(self.prompt_ids) + len(self.output_ids) >= context_length:
            return {"type": "length", "length": len(self.output_ids)}
        return None

    def finish(self, reason: dict) -> None:
        self.finish_reason = reason
        self.state = State.FINISHED
        self.slot = None
        self.finished_at = time.perf_counter()
        self.notify(force=True)

    # ----- telling the HTTP side -----------------------------------------------------------

    def notify(self, force: bool = False, stream_interval: int = 1) -> None:
        """Tell the listener how many tokens are ready: each ``stream_interval`` tokens when
        streaming, and always on finish."""
        if self.listener is None:
            return
        self._since_notify += 1
        interval = self.params.stream_interval or stream_interval
        if force or (self.stream and self._since_notify >= interval):
            self._since_notify = 0
            self.listener(len(self.output_ids), self.finished)

    def weight_version_spans(self) -> list[dict]:
        """Runs of output tokens produced by the same weight version."""
        spans: list[dict] = []
        for index, version in enumerate(self.versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = index + 1
            else:
                spans.append({"version": version, "start": index, "end": index + 1})
        return spans


def _tail_tokens(stops: tuple[str, ...]) -> int:
    """How many trailing tokens always cover the longest stop string (a token is >= 1 byte)."""
    return max(len(s.encode()) for s in stops) + 1
