"""One completion through the engines, uninterrupted as the client sees it.

An engine answers a request with ``finish_reason.type == "abort"`` when a weight swap pauses it
(or it is aborted); this module then resubmits prompt + tokens so far with the remaining budget,
on the same engine, which holds the request until the swap is done. An engine that fails is
left for another one, again resuming from the tokens already received; an engine that refuses
the request (``EngineRejected``: the request's fault) ends it and stays in rotation; so do an
abort that carries an HTTP status (the engine failed this request: a prefill out of memory) and
a request that outlasts the request timeout (``EngineTimedOut``). Each token
keeps the policy version that sampled it. This module knows nothing about chat, sessions or
the store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from server.engine_client.client import EngineUnavailable, Piece
from server.engine_client.pool import EnginePool, EngineState, NoEngineAvailable, parse_version
from server.errors import EngineRejected, EngineTimedOut

MAX_RESUMES = 32  # swaps or engine failures one completion may live through
# How long a request waits for an engine to come (back) into rotation before it is refused
# (503): long enough to re-probe an engine that missed a health check, short enough that a
# client whose engines are gone learns it at once, before any byte of a stream.
ENGINE_WAIT_S = 2.0


@dataclass(frozen=True)
class SamplingRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:  # an engine asked for no tokens answers with nothing to store
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")


@dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: dict = field(default_factory=dict)
    engine: str | None = None
    resumes: int = 0

    def add(self, piece: Piece) -> None:
        self.ids += piece.ids
        self.logprobs += piece.logprobs
        self.top += piece.top
        self.versions += map(_version, piece.versions)


# A token's version as the store keeps it, read once per version string an engine reports
# (every token carries one; a regex per token was work for nothing).
_version = lru_cache(maxsize=1024)(parse_version)

OnPiece = Callable[[Piece], None]  # sees each streamed piece as it comes (no await: per token)


def engine_body(request: SamplingRequest, so_far: list[int], rid: str) -> dict:
    params: dict = {
        "max_new_tokens": request.max_tokens - len(so_far),
        "temperature": request.temperature,
        "skip_special_tokens": False,
    }
    if request.stop:
        params["stop"] = list(request.stop)
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    if request.ignore_eos:
        params["ignore_eos"] = True
    body = {
        "input_ids": request.prompt_ids + so_far,
        "sampling_params": params,
        "return_logprob": True,
        "rid": rid,
    }
    if request.top_logprobs:
        body["top_logprobs_num"] = request.top_logprobs
    return body


async def _attempt(
    engine: EngineState,
    body: dict,
    stream: bool,
    completion: Completion,
    on_piece: OnPiece | None,
) -> dict:
    """One engine request; returns its finish reason. Tokens land in ``completion`` as they come."""
    start = len(completion.ids)
    final: Piece | None = None
    engine.in_flight += 1
    try:
        if stream:
            pieces = engine.client.generate_stream(body, engine.incremental_streaming)
            async for piece in pieces:
                completion.add(piece)
                engine.served_tokens += len(piece.ids)
                if on_piece is not None and piece.ids:
                    on_piece(piece)
                final = piece if piece.finish_reason is not None else final
        else:
            final = await engine.client.generate(body)
            completion.add(final)
            engine.served_tokens += len(final.ids)
            if on_piece is not None and final.ids:
                on_piece(final)
    finally:
        engine.in_flight -= 1
    if final is None or final.finish_reason is None:
        raise EngineUnavailable(f"{engine.url} ended the request without a finish reason")
    if final.all_versions is not None:  # spans on the final output are authoritative
        count = len(completion.ids) - start
        completion.versions[start:] = map(_version, final.all_versions[-count:])
    return final.finish_reason


async def complete(
    pool: EnginePool,
    request: SamplingRequest,
    rid: str,
    prefer: str | None = None,
    stream: bool = False,
    on_piece: OnPiece | None = None,
) -> Completion:
    """Sample one completion of ``request``, resuming across weight swaps and engine failures."""
    completion = Completion(prompt_ids=request.prompt_ids)
    failed: set[str] = set()
    while True:
        if not pool.healthy and not await pool.wait_for_engine(ENGINE_WAIT_S):
            raise NoEngineAvailable("no engine is available to serve this request")
        engine = pool.pick(prefer=completion.engine or prefer, avoid=failed)
        completion.engine = engine.url
        body = engine_body(request, completion.ids, f"{rid}-{completion.resumes}")
        try:
            reason = await _attempt(engine, body, stream, completion, on_piece)
        except EngineTimedOut:
            raise  # the request's time is spent; the engine may well be fine
        except EngineUnavailable as exc:
            pool.mark_down(engine, str(exc))
            failed.add(engine.url)
            reason = {"type": "abort", "message": str(exc)}
        if reason.get("type") != "abort":
            completion.finish_reason = reason
            return completion
        _raise_for_abort_status(engine.url, reason)
        if len(completion.ids) >= request.max_tokens:  # aborted with the budget spent
            completion.finish_reason = {"type": "length", "length": request.max_tokens}
            return completion
        completion.resumes += 1
        if completion.resumes > MAX_RESUMES:
            raise NoEngineAvailable(f"gave up after {MAX_RESUMES} interruptions: {reason}")


def _raise_for_abort_status(url: str, reason: dict) -> None:
    """An abort that carries an HTTP status (the engine refused or failed this request: a
    prefill that ran out of memory, say) ends the request: resubmitting it would fail again.
    Aborts without one (a pause, an abort request, a stopping engine) are resumed."""
    status = reason.get("status_code")
    if not isinstance(status, int) or isinstance(status, bool):
        return
    message = str(reason.get("message") or "aborted")
    if 400 <= status < 500:
        raise EngineRejected(status, message)
    raise EngineUnavailable(f"{url}: {message}")
