"""An async client for one engine's native HTTP API (SGLang or the embedded engine).

It turns ``/generate`` answers (whole or streamed, cumulative or incremental) into
:class:`Piece` objects: the new token ids with their logprobs and the weight version of each
token, plus the finish reason when the request ended. Failures come out as two exceptions of
``server.errors``' tree:
:class:`EngineUnavailable` (the engine is gone, timed out or broke: try another) and
:class:`EngineRejected` (it refused the request: do not retry). A streamed request SGLang
refuses is answered with HTTP 200 and the error in-band (docs/architecture/sglang-protocol.md,
"In-band errors"); an in-band error with a 4xx code that is not marked retryable is a refusal
too. Every call has a timeout.

LoRA adapters are loaded and unloaded by name (``load_lora_adapter``, ``unload_lora_adapter``:
SGLang's routes, docs/architecture/sglang-protocol.md, "LoRA adapters"); an answer with
``success: false`` (SGLang sends it with a 400) is :class:`EngineRejected` with SGLang's
``error_message``. A generate body is sent as built, so its ``lora_path`` (the adapter's name,
or one per batch item) reaches the engine unchanged.

It runs on aiohttp: on this hot path (every request, every streamed token) it took a third of
httpx's CPU time per request in our measurement.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from server.errors import EngineError, EngineRejected, EngineTimedOut, EngineUnavailable

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=60.0, connect=5.0)
WEIGHTS_TIMEOUT = aiohttp.ClientTimeout(total=600.0, connect=5.0)
# An adapter load reads its files; an unload waits for the requests running on the adapter.
ADAPTER_TIMEOUT_S = 600.0
_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


@dataclass
class Piece:
    """New output of a generate request: tokens since the last piece, and the end if it ended."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict | None = None
    prompt_tokens: int | None = None
    # On the final piece of a request: the version of every token of that request, by span.
    all_versions: list[str] | None = None


def joined(pieces: list[Piece]) -> Piece:
    """Consecutive pieces of one request as one: their tokens, logprobs and versions in order
    (top logprobs where every piece has them), the last one's end."""
    if len(pieces) == 1:
        return pieces[0]
    ids = [token for piece in pieces for token in piece.ids]
    top_everywhere = all(len(piece.top) == len(piece.ids) for piece in pieces)
    return Piece(
        ids=ids,
        logprobs=[value for piece in pieces for value in piece.logprobs],
        top=[entry for piece in pieces for entry in piece.top] if top_everywhere else [],
        versions=[version for piece in pieces for version in piece.versions],
        finish_reason=pieces[-1].finish_reason,
        prompt_tokens=pieces[0].prompt_tokens,
        all_versions=pieces[-1].all_versions,
    )


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):  # SGLang's LoRA answers say error_message
        return str(error.get("message") or error.get("error_message") or error)
    return str(error)


def in_band_error(url: str, error: Any) -> EngineError:
    """What an ``{"error": ...}`` event inside a stream means: the client's fault (a 4xx code,
    not retryable: :class:`EngineRejected`), or the engine's (anything else, including 0.5.10's
    bare ``{"message"}``: :class:`EngineUnavailable`)."""
    message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
    code = error.get("code") if isinstance(error, dict) else None
    retryable = isinstance(error, dict) and bool(error.get("retryable"))
    try:
        status = int(code) if code is not None and not isinstance(code, bool) else 0
    except (TypeError, ValueError):
        status = 0
    if 400 <= status < 500 and not retryable:
        return EngineRejected(status, message)
    return EngineUnavailable(f"{url}: {message}")


def _versions_from_spans(meta: dict, count: int) -> list[str] | None:
    spans = meta.get("weight_versions")
    if not spans:
        return None
    versions = [str(meta.get("weight_version", ""))] * count
    for span in spans:
        for index in range(span["start"], min(span["end"], count)):
            versions[index] = str(span["version"])
    return versions


def piece_from_output(output: dict, already: int = 0, cumulative: bool = True) -> Piece:
    """The new part of one /generate output; ``already`` tokens were seen before (cumulative)."""
    meta = output.get("meta_info", {})
    start = already if cumulative else 0
    ids = list(output.get("output_ids", []))[start:]
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    finish = meta.get("finish_reason")
    piece = Piece(
        ids=ids,
        logprobs=[float(e[0]) for e in entries[start:]],
        top=[[(float(t[0]), int(t[1])) for t in (pos or [])] for pos in tops[start:]],
        versions=[str(meta.get("weight_version", ""))] * len(ids),
        finish_reason=finish,
        prompt_tokens=meta.get("prompt_tokens"),
    )
    if len(piece.logprobs) != len(ids):
        raise EngineUnavailable(f"engine sent {len(ids)} tokens but {len(piece.logprobs)} logprobs")
    if finish is not None:
        total = meta.get("completion_tokens", already + len(ids) if cumulative else len(ids))
        piece.all_versions = _versions_from_spans(meta, int(total))
    return piece


class EngineClient:
    def __init__(self, url: str, http: aiohttp.ClientSession, generate_timeout: float) -> None:
        self.url = url.rstrip("/")
        self._http = http
        self._generate_timeout = aiohttp.ClientTimeout(total=generate_timeout, connect=5.0)

    async def _post(self, path: str, body: dict, timeout: aiohttp.ClientTimeout) -> Any:
        try:
            async with self._http.post(f"{self.url}{path}", json=body, timeout=timeout) as reply:
                text = await reply.text()
                self._raise_for_status(reply.status, path, text)
        except _FAILURES as exc:
            raise EngineUnavailable(f"{self.url}{path}: {exc!r}") from exc
        return json.loads(text) if text else None

    def _raise_for_status(self, status: int, path: str, text: str) -> None:
        if status >= 500:
            raise EngineUnavailable(f"{self.url}{path}: {status}")
        if status >= 400:
            raise EngineRejected(status, _error_message(text))

    async def _get(self, path: str) -> dict:
        try:
            async with self._http.get(f"{self.url}{path}", timeout=CONTROL_TIMEOUT) as reply:
                text = await reply.text()
                self._raise_for_status(reply.status, path, text)
        except _FAILURES as exc:
            raise EngineUnavailable(f"{self.url}{path}: {exc!r}") from exc
        return json.loads(text)

    # ----- generation ---------------------------------------------------------------------

    async def generate(self, body: dict) -> Piece:
        try:
            output = await self._post(
                "/generate", {**body, "stream": False}, self._generate_timeout
            )
        except EngineUnavailable as exc:
            raise self._failure(exc, exc.__cause__) from exc.__cause__
        return piece_from_output(output)

    def _failure(self, unavailable: EngineUnavailable, cause: BaseException | None) -> EngineError:
        """``unavailable``, or EngineTimedOut where ``cause`` is the generate timeout running out
        (the request's time is spent: not tried again)."""
        if isinstance(cause, TimeoutError):
            seconds = self._generate_timeout.total
            return EngineTimedOut(f"{self.url}/generate did not finish within {seconds:g} s")
        return unavailable

    async def generate_stream(self, body: dict, incremental: bool) -> AsyncIterator[Piece]:
        """Pieces as the engine streams them, read as they come: the events of one read (several
        when the engine got ahead of this process) as one piece. The last carries the finish
        reason."""
        seen = 0
        url = f"{self.url}/generate"
        try:
            async with self._http.post(
                url, json={**body, "stream": True}, timeout=self._generate_timeout
            ) as reply:
                if reply.status >= 400:
                    self._raise_for_status(reply.status, "/generate", await reply.text())
                # The ``data:`` payloads of the server-sent events, read here rather than through
                # another generator (a layer per streamed token); lines may be long: cumulative
                # SGLang chunks grow with the output.
                buffer = b""
                async for block in reply.content.iter_any():
                    buffer += block
                    *lines, buffer = buffer.split(b"\n")
                    piece, done, error = self._read(lines, seen, incremental)
                    # The tokens before an error are kept (a resume starts after them).
                    if piece is not None:
                        seen += len(piece.ids)
                        yield piece
                    if error is not None:
                        raise error
                    if done:
                        return
        except _FAILURES as exc:
            raise self._failure(EngineUnavailable(f"{url} broke off: {exc!r}"), exc) from exc
        raise EngineUnavailable(f"{url} ended without [DONE]")

    def _read(
        self, lines: list[bytes], seen: int, incremental: bool
    ) -> tuple[Piece | None, bool, EngineError | None]:
        """The new tokens of a stream's complete ``lines`` as one piece (None: none came;
        ``seen`` tokens came before them); whether ``[DONE]`` came, and the in-band error that
        ended the stream, if one did."""
        pieces: list[Piece] = []
        done, error = False, None
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data.decode())  # text: json.loads of bytes detects the encoding
            if "error" in chunk:
                error = in_band_error(self.url, chunk["error"])
                break
            pieces.append(piece_from_output(chunk, seen, cumulative=not incremental))
            seen += len(pieces[-1].ids)
        return (joined(pieces) if pieces else None), done, error

    # ----- control --------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode}, WEIGHTS_TIMEOUT)

    async def resume(self) -> None:
        await self._post("/continue_generation", {}, CONTROL_TIMEOUT)

    async def update_weights_from_disk(self, model_path: str, version: str) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": version, "flush_cache": True}
        return await self._post("/update_weights_from_disk", body, WEIGHTS_TIMEOUT)

    async def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post("/init_weights_update_group", body, WEIGHTS_TIMEOUT)

    async def update_weights_from_distributed(
        self, body: dict[str, Any], version: str
    ) -> dict[str, Any]:
        """Receive a broadcast inside a weight-update session (0.5.23 needs one; older builds
        answer 404 to the session calls and load directly)."""
        try:
            await self._post("/begin_weight_update", {"selector": "all"}, CONTROL_TIMEOUT)
            in_session = True
        except EngineRejected as exc:
            if exc.engine_status != 404:
                raise
            in_session = False
        try:
            body = {**body, "weight_version": version, "flush_cache": True}
            return await self._post("/update_weights_from_distributed", body, WEIGHTS_TIMEOUT)
        finally:
            if in_session:
                await self._post("/end_weight_update", {}, CONTROL_TIMEOUT)

    async def update_weight_version(self, version: str) -> None:
        body = {"new_version": version, "abort_all_requests": False}
        await self._post("/update_weight_version", body, CONTROL_TIMEOUT)

    async def weights_probe(self, path: str, token: str) -> str | None:
        """Why this engine cannot read the trainer's probe (None: it can). An engine without
        the route (SGLang's own answers 404) raises EngineRejected: it cannot be asked."""
        body = {"path": path, "token": token}
        answer = await self._post("/weights_probe", body, CONTROL_TIMEOUT)
        return None if answer.get("success") else str(answer.get("message"))

    async def load_lora_adapter(
        self, name: str, path: str, pinned: bool = False, timeout_s: float = ADAPTER_TIMEOUT_S
    ) -> dict[str, Any]:
        """Load the adapter at ``path`` (a directory the engine reads) under ``name``; its answer
        (``loaded_adapters``: name to path of every adapter it holds). SGLang may unload its
        least recently used unpinned adapter to stay within ``--max-loaded-loras``."""
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return await self._adapter_call("/load_lora_adapter", body, timeout_s)

    async def unload_lora_adapter(
        self, name: str, timeout_s: float = ADAPTER_TIMEOUT_S
    ) -> dict[str, Any]:
        """Unload adapter ``name``: no new request gets it at once; the engine answers once the
        requests running on it have ended."""
        return await self._adapter_call("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def _adapter_call(self, path: str, body: dict, timeout_s: float) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(5.0, timeout_s))
        try:
            answer = await self._post(path, body, timeout)
        except EngineUnavailable as exc:
            if isinstance(exc.__cause__, TimeoutError):
                message = f"{self.url}{path} did not answer within {timeout_s:g} s"
                raise EngineTimedOut(message) from exc.__cause__
            raise
        if not isinstance(answer, dict):
            raise EngineUnavailable(f"{self.url}{path}: answered {answer!r}, not an object")
        if not answer.get("success", False):  # a refusal SGLang sent with 200 would come here
            raise EngineRejected(400, str(answer.get("error_message") or answer))
        return answer

    async def abort(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid}, CONTROL_TIMEOUT)

    async def model_info(self) -> dict:
        return await self._get("/model_info")

    async def server_info(self) -> dict:
        return await self._get("/server_info")

    async def models(self) -> dict:
        """``/v1/models``: SGLang reports its effective context here (``max_model_len``)."""
        return await self._get("/v1/models")

    async def loads(self) -> dict:
        """Running and waiting requests, token usage, throughput (``/v1/loads``)."""
        return await self._get("/v1/loads")
