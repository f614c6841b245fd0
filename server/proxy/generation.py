"""One completion through the engines, uninterrupted as the client sees it.

An engine answers a request with ``finish_reason.type == "abort"`` when a weight swap pauses it
(or it is aborted); this module then resubmits prompt + tokens so far with the remaining budget,
on the same engine, which holds the request until the swap is done. An engine that fails is
left for another one, again resuming from the tokens already received; an engine that refuses
the request (``EngineRejected``: the request's fault) ends it and stays in rotation; so do an
abort that carries an HTTP status (the engine failed this request: a prefill out of memory) and
a request that outlasts the request timeout (``EngineTimedOut``). Each token
keeps the policy version that sampled it.

A LoRA run's request names its adapter (``ServedAdapter``: the run's version when the request
came); an engine is loaded with it before it serves the request, once (``AdapterLoads``), and
every token of the completion carries that version, whatever the engine's base weights are
tagged (a LoRA publish pauses nothing: a request started before it finishes on the adapter it
began with). An engine that no longer holds the adapter (it restarted) is loaded again. This
module knows nothing about chat or sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from server.engine_client.adapters import AdapterLoads
from server.engine_client.client import EngineUnavailable, Piece
from server.engine_client.pool import EnginePool, EngineState, NoEngineAvailable, parse_version
from server.errors import EngineError, EngineRejected, EngineTimedOut
from server.store.run_adapters import ServedAdapter

MAX_RESUMES = 32  # swaps or engine failures one completion may live through
# How long a request waits for an engine to come (back) into rotation before it is refused
# (503): long enough to re-probe an engine that missed a health check, short enough that a
# client whose engines are gone learns it at once, before any byte of a stream.
ENGINE_WAIT_S = 2.0
# How long a request waits for an engine to load its run's adapter before it tries another (the
# load goes on for the requests after it).
ADAPTER_LOAD_WAIT_S = 60.0


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


def engine_body(
    request: SamplingRequest, so_far: list[int], rid: str, adapter: str | None = None
) -> dict:
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
    if adapter is not None:
        body["lora_path"] = adapter  # SGLang's field: the adapter's name, not a path
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
    adapter: ServedAdapter | None = None,
    loads: AdapterLoads | None = None,
) -> Completion:
    """Sample one completion of ``request`` (with ``adapter``, loaded where needed through
    ``loads``), resuming across weight swaps and engine failures."""
    completion = Completion(prompt_ids=request.prompt_ids)
    failed: set[str] = set()
    attempt = _Lora(adapter, loads).attempt if adapter and loads else _attempt
    while True:
        if not pool.healthy and not await pool.wait_for_engine(ENGINE_WAIT_S):
            raise NoEngineAvailable("no engine is available to serve this request")
        engine = pool.pick(prefer=completion.engine or prefer, avoid=failed)
        completion.engine = engine.url
        name = adapter.name if adapter is not None else None
        body = engine_body(request, completion.ids, f"{rid}-{completion.resumes}", name)
        try:
            reason = await attempt(engine, body, stream, completion, on_piece)
        except EngineTimedOut:
            raise  # the request's time is spent; the engine may well be fine
        except AdapterUnavailable as exc:  # that engine cannot serve this run; others may
            failed.add(engine.url)
            if all(e.url in failed for e in pool.healthy):
                raise NoEngineAvailable(str(exc)) from exc
            continue
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


class AdapterUnavailable(Exception):
    """An engine could not load the request's adapter: another engine may."""


@dataclass
class _Lora:
    """A completion served with a LoRA run's ``adapter``: each engine holds it before it serves
    the request (loaded through ``loads`` if not), and every token is the adapter's version."""

    adapter: ServedAdapter
    loads: AdapterLoads
    reloaded: set[str] = field(default_factory=set)  # engines that lost it and got it again

    async def attempt(
        self,
        engine: EngineState,
        body: dict,
        stream: bool,
        completion: Completion,
        on_piece: OnPiece | None,
    ) -> dict:
        """``_attempt`` on an engine that holds the adapter; an engine that answers that it
        does not (it restarted since this proxy loaded it) is loaded again, once, and the
        request resumed."""
        adapter, start = self.adapter, len(completion.ids)
        try:
            with self.loads.running(engine.url, adapter.name):
                try:  # refused, down, or slow: another engine may have it, or load it sooner
                    loading = self.loads.ensure(
                        engine.client, adapter.name, adapter.path, adapter.pinned
                    )
                    await asyncio.wait_for(loading, ADAPTER_LOAD_WAIT_S)
                except (EngineError, TimeoutError) as exc:
                    raise AdapterUnavailable(
                        f"{engine.url} could not load adapter {adapter.name!r} from "
                        f"{adapter.path!r}: {exc or 'it did not answer in time'}"
                    ) from exc
                return await _attempt(engine, body, stream, completion, on_piece)
        except EngineRejected as exc:
            if engine.url in self.reloaded or adapter.name not in str(exc):
                raise
            self.loads.forget(engine.url, adapter.name)
            self.reloaded.add(engine.url)
            return {"type": "abort", "message": str(exc)}
        finally:  # its tokens are the adapter's version, not the base weights'
            completion.versions[start:] = [adapter.version] * (len(completion.ids) - start)


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
