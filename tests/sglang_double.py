"""A stand-in for an SGLang 0.5.23 server: a reverse proxy in front of a real embedded engine that
shows SGLang's documented quirks, which the embedded engine itself does not (it reports more than
SGLang does, and refuses bad streamed requests before the stream starts).

Each quirk, with the section of ``docs/architecture/sglang-protocol.md`` that documents it:

* ``/server_info``: ``context_length`` is the launch argument, ``None`` unless ``--context-length``
  was given; ``tp_size`` is the launch argument ("Info and health", "Context length").
* ``/v1/models``: the effective context as ``data[0].max_model_len`` ("Info and health",
  "Context length").
  ``--advertise-context N`` reports N instead (0: no ``max_model_len`` at all), to face a proxy
  with an engine that reports its context wrongly or not at all.
* ``/generate`` with ``"stream": true``: a request the engine refuses as a value error (HTTP 400
  ``{"error": {"message": ...}}``, "Error shapes") is answered with HTTP 200 and the error in-band,
  ``data: {"error": {"message", "type": "invalid_request_error", "code": 400, "retryable":
  false}}`` then ``data: [DONE]`` ("In-band errors"). Schema errors (``{"error": "<text>"}``)
  stay HTTP 400: 0.5.23 checks the schema before the stream starts ("The /generate request").
* LoRA adapters ("LoRA adapters"): ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter``
  answer SGLang's ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``; 400
  when ``success`` is false) from a registry of SGLang's rules, kept here: refused unless started
  with ``--enable-lora``; a name loaded twice refused; at most ``--max-loras-per-batch`` - 1
  pinned; past ``--max-loaded-loras`` the least recently used unpinned adapter is unloaded (not
  refused); an unload waits for the requests using the adapter. ``/generate``'s ``lora_path``
  (a name, or one per batch item) is refused unless enabled, refused for a name never loaded,
  and *reloads* a name that was loaded once and unloaded or evicted since. ``/v1/models`` lists
  each loaded adapter after the base model; ``/v1/models/{id}`` finds the base model only. The
  adapter itself is loaded into (and unloaded from) the engine behind the double, which applies
  it; an engine without the routes (404) only leaves the double's registry to answer. The engine
  must hold one adapter more than ``--max-loaded-loras`` (the double loads, then evicts; the
  embedded engine refuses past its own bound rather than evict): the double gives the engine it
  starts that bound.
* ``/init_weights_update_group``: an engine of tensor-parallel size t joins the group as ranks
  ``rank_offset .. rank_offset + t - 1`` ("Ranks under tensor parallelism"). The engine behind the
  double holds one rank, so the double cannot take part in a real group of that size: it records the
  request (see ``GET /_double/stats``) and answers success without joining.

Its command line takes the flags proxrl passes to ``python -m sglang.launch_server``
(``--model-path``, ``--host``, ``--port``, ``--tp-size``, ``--base-gpu-id``, ``--weight-version``,
``--context-length``, and SGLang's LoRA flags: ``--enable-lora``, ``--max-loaded-loras``,
``--max-loras-per-batch``, ``--max-lora-rank``, ``--lora-target-modules``,
``--lora-eviction-policy``), so ``proxrl serve --engine sglang --sglang-module tests.sglang_double``
can launch it. With ``--upstream URL`` it fronts a running engine; without, it starts an embedded
engine of its own on the model (stopped with it). Everything else is passed through unchanged.
``GET /_double/stats`` counts the ``/generate`` requests it received, lists the weight-group
joins, and the ``lora_path`` of each ``/generate`` it forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from server.common.processes import EngineProcess, ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
STATS_PATH = "/_double/stats"
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=600.0, connect=5.0)
_FORWARDED_HEADERS = ("Content-Type", "Authorization")


def in_band_error(message: str) -> web.Response:
    """SGLang's answer to a streamed request it refuses: HTTP 200, the error, ``[DONE]``."""
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    body = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"
    return web.Response(status=200, text=body, content_type="text/event-stream")


def validation_error(needs: str) -> web.Response:
    """SGLang's answer to a body its schema refuses on a route other than /generate."""
    message = f"The request body needs {needs}."
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    return web.json_response(body, status=400)


async def _json_body(request: web.Request) -> dict:
    return _json_object((await request.read()).decode(errors="replace"))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# SGLang's answers about LoRA, word for word (sglang-protocol.md, "LoRA adapters").
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
NOT_ENABLED_FOR_REQUEST = (
    "LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
)
ALREADY_LOADED = "Failed to load LoRA adapter {name} because it is already loaded"
NO_DORA = "Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
INCOMPATIBLE = (
    "LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
)
TOO_MANY_PINNED = (
    "Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots in "
    "the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
)
NO_SUCH_ADAPTER = "LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
NEVER_LOADED = "Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {ever}."
NOT_LOADED = (
    "The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {loaded}."
)
RELOAD_FAILED = "Failed to implicitly load LoRA adapter {name}: {message}"
TOO_MANY_IN_REQUEST = (
    "Received request with {count} unique loras requested but max loaded loras is {limit}"
)


@dataclass
class LoRAFlags:
    """SGLang's LoRA launch flags, as the double was started with."""

    enabled: bool = False
    max_loaded: int | None = None
    max_per_batch: int = 8
    max_rank: int | None = None
    target_modules: list[str] | None = None


@dataclass
class Registered:
    path: str
    pinned: bool
    users: int = 0  # requests running on it


def lora_update(success: bool, message: str, loaded: dict[str, str] | None) -> web.Response:
    """SGLang's ``LoRAUpdateOutput`` as its HTTP handlers send it: 200, or 400 when it failed."""
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": message,
        "loaded_adapters": loaded,
    }
    return web.json_response(body, status=200 if success else 400)


def _adapter_config(path: str) -> dict:
    """``adapter_config.json`` of ``path``, or {} (then the engine behind says what is wrong)."""
    try:
        value = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class Adapters:
    """SGLang's adapter registry (its tokenizer manager's ``LoRARegistry``, its load, unload and
    resolution of ``lora_path``): names in least-recently-used order (a load or a request is a
    use), every name ever loaded and its path (what a request may reload), and how many requests
    run on each. ``engine`` loads into and unloads from the engine behind the double."""

    def __init__(self, flags: LoRAFlags, engine: Double) -> None:
        self.flags = flags
        self.engine = engine
        self.loaded: OrderedDict[str, Registered] = OrderedDict()
        self.ever: dict[str, tuple[str, bool]] = {}
        self.lock = asyncio.Lock()  # one load or unload at a time, as SGLang's lora_update_lock
        self.released = asyncio.Condition()

    def listing(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self.loaded.items()}

    def _refusal(self, name: str, path: str, pinned: bool) -> str | None:
        """Why SGLang's backend refuses to load ``name`` from ``path`` (validate_new_adapter)."""
        config = _adapter_config(path)
        if config.get("use_dora"):
            return NO_DORA.format(name=name)
        if name in self.loaded:
            return ALREADY_LOADED.format(name=name)
        rank, targets = config.get("r"), config.get("target_modules")
        too_big = (
            self.flags.max_rank is not None and isinstance(rank, int) and rank > self.flags.max_rank
        )
        allowed = self.flags.target_modules
        outside = (
            allowed is not None
            and "all" not in allowed
            and isinstance(targets, list)
            and not set(targets) <= set(allowed)
        )
        if too_big or outside:
            return INCOMPATIBLE.format(name=name, rank=rank)
        pinned_now = sum(adapter.pinned for adapter in self.loaded.values())
        if pinned and pinned_now >= self.flags.max_per_batch - 1:
            return TOO_MANY_PINNED.format(name=name)
        return None

    async def load(self, name: str, path: str, pinned: bool) -> tuple[bool, str, dict | None]:
        """Load ``name``; then, past ``--max-loaded-loras``, unload the least recently used
        unpinned adapters (SGLang does not refuse)."""
        if not self.flags.enabled:
            return False, NOT_ENABLED, None
        async with self.lock:
            problem = self._refusal(name, path, pinned)
            if problem is None:
                problem = await self.engine.adapter_call(
                    "/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned}
                )
            if problem is not None:
                return False, problem, self.listing()
            self.loaded[name] = Registered(path, pinned)
            self.ever[name] = (path, pinned)
            listing = self.listing()
            limit = self.flags.max_loaded
            while limit is not None and len(self.loaded) > limit:
                victim = next(n for n, adapter in self.loaded.items() if not adapter.pinned)
                success, message, _ = await self._unload(victim)
                if not success:
                    return (
                        False,
                        f"Error while unloading LRU LoRA adapter '{victim}': {message}",
                        None,
                    )
                del listing[victim]
            return True, "", listing

    async def unload(self, name: str) -> tuple[bool, str, dict | None]:
        if not self.flags.enabled:
            return False, NOT_ENABLED, None
        async with self.lock:
            return await self._unload(name)

    async def _unload(self, name: str) -> tuple[bool, str, dict | None]:
        """Out of the registry at once (no new request gets it), out of the engine once the
        requests running on it have ended."""
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            return False, NO_SUCH_ADAPTER.format(name=name, loaded=self.loaded.keys()), None
        async with self.released:
            await self.released.wait_for(lambda: adapter.users == 0)
        problem = await self.engine.adapter_call("/unload_lora_adapter", {"lora_name": name})
        return problem is None, problem or "", self.listing()

    async def acquire(self, lora_path: Any) -> list[Registered]:
        """The adapters a request names (one, or one per batch item; null: the base model),
        each held until ``release``; ValueError with SGLang's message where SGLang refuses."""
        if not lora_path:
            return []
        names = [lora_path] if isinstance(lora_path, str) else list(lora_path)
        if not self.flags.enabled:
            first = next((name for name in names if name), None)
            raise ValueError(NOT_ENABLED_FOR_REQUEST.format(name=first))
        await self._reload(set(names))
        gone = [name for name in names if name is not None and name not in self.loaded]
        if gone:  # unloaded again while it was being reloaded
            raise ValueError(NOT_LOADED.format(name=gone[0], loaded=self.loaded.keys()))
        held = [self.loaded[name] for name in names if name is not None]
        for name, adapter in zip([n for n in names if n is not None], held, strict=True):
            self.loaded.move_to_end(name)
            adapter.users += 1
        return held

    async def _reload(self, unique: set[str | None]) -> None:
        """Load again each of ``unique`` that was loaded once and is not now (unloaded, or
        evicted); refuse a name never loaded. A null entry counts as a name here, as in SGLang."""
        limit = self.flags.max_loaded
        if limit is not None and len(unique) > limit:
            raise ValueError(TOO_MANY_IN_REQUEST.format(count=len(unique), limit=limit))
        for name in unique:
            if name is None or name in self.loaded:
                continue
            if name not in self.ever:
                raise ValueError(NEVER_LOADED.format(name=name, ever=self.ever.keys()))
            success, message, _ = await self.load(name, *self.ever[name])
            if not success and "already loaded" not in message:
                raise ValueError(RELOAD_FAILED.format(name=name, message=message))

    async def release(self, held: list[Registered]) -> None:
        async with self.released:
            for adapter in held:
                adapter.users -= 1
            self.released.notify_all()


def _lora_path_problem(value: Any) -> str | None:
    """The schema check's refusal of a ``lora_path`` of the wrong type (a 400 whose ``error`` is
    a string, as for any field), or None."""
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, list) and all(v is None or isinstance(v, str) for v in value):
        return None
    return f"lora_path: invalid type: expected a string, a list of strings or null, got {value!r}"


class Double:
    def __init__(
        self,
        upstream: str,
        tp_size: int,
        context_length: int | None,
        advertise: int | None,
        lora: LoRAFlags | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.tp_size = tp_size
        self.context_length = context_length
        self.advertise = advertise
        self.generate_requests = 0
        self.joins: list[dict] = []
        self.lora_paths: list[Any] = []  # of the /generate requests forwarded
        self.adapters = Adapters(lora or LoRAFlags(), self)
        self.http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.cleanup_ctx.append(self._session)
        app.router.add_get(STATS_PATH, self.stats)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_card)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_post("/init_weights_update_group", self.join_group)
        app.router.add_post("/load_lora_adapter", self.load_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_adapter)
        app.router.add_post("/weights_probe", self.not_sglangs)  # the embedded engine's own
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def _session(self, app: web.Application):
        self.http = aiohttp.ClientSession(timeout=UPSTREAM_TIMEOUT)
        yield
        await self.http.close()

    # ----- pass-through ----------------------------------------------------------------------

    async def _open(self, request: web.Request, body: bytes) -> aiohttp.ClientResponse:
        assert self.http is not None
        headers = {k: request.headers[k] for k in _FORWARDED_HEADERS if k in request.headers}
        url = f"{self.upstream}{request.path_qs}"
        return await self.http.request(request.method, url, data=body, headers=headers)

    async def _relay(self, request: web.Request, reply: aiohttp.ClientResponse):
        response = web.StreamResponse(status=reply.status)
        if "Content-Type" in reply.headers:
            response.headers["Content-Type"] = reply.headers["Content-Type"]
        await response.prepare(request)
        async for block in reply.content.iter_any():
            await response.write(block)
        await response.write_eof()
        return response

    async def forward(self, request: web.Request, body: bytes | None = None):
        body = await request.read() if body is None else body
        try:
            reply = await self._open(request, body)
        except (aiohttp.ClientError, TimeoutError) as exc:  # as SGLang while it starts
            return web.json_response({"error": {"message": f"engine: {exc!r}"}}, status=503)
        async with reply:
            return await self._relay(request, reply)

    async def _upstream_json(self, request: web.Request) -> dict:
        reply = await self._open(request, b"")
        async with reply:
            reply.raise_for_status()
            return await reply.json()

    # ----- the quirks ------------------------------------------------------------------------

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self._upstream_json(request)
        info.update(context_length=self.context_length, tp_size=self.tp_size)
        return web.json_response(info)

    async def models(self, request: web.Request) -> web.Response:
        listing = await self._upstream_json(request)
        cards = listing.get("data", [])
        for card in cards:
            if self.advertise == 0:
                card.pop("max_model_len", None)
            elif self.advertise is not None:
                card["max_model_len"] = self.advertise
        if self.adapters.flags.enabled and cards:
            base = cards[0]
            cards[1:] = [  # the engine's own adapter cards, if any, give way to SGLang's
                {**base, "id": name, "root": path, "parent": base["id"], "max_model_len": None}
                for name, path in self.adapters.listing().items()
            ]
        return web.json_response(listing)

    async def model_card(self, request: web.Request) -> web.Response:
        """SGLang finds only the base model here, not an adapter it lists in /v1/models."""
        cards = (await self._upstream_json(request.clone(rel_url="/v1/models"))).get("data", [])
        model = request.match_info["model"]
        if cards and model == cards[0].get("id"):
            return await self.forward(request)
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return web.json_response({"error": error}, status=404)

    async def generate(self, request: web.Request):
        self.generate_requests += 1
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("lora_path") is None:
            return await self._generate(request, raw, body)
        streamed = body.get("stream") is True
        problem = _lora_path_problem(body["lora_path"])
        if problem is not None:
            return web.json_response({"error": problem}, status=400)
        try:
            held = await self.adapters.acquire(body["lora_path"])
        except ValueError as exc:  # refused while resolving, before the scheduler: a value error
            if streamed:
                return in_band_error(str(exc))
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        self.lora_paths.append(body["lora_path"])
        try:
            return await self._generate(request, raw, body)
        finally:
            await self.adapters.release(held)

    async def _generate(self, request: web.Request, raw: bytes, body: Any):
        if not (isinstance(body, dict) and body.get("stream") is True):
            return await self.forward(request, raw)
        try:
            reply = await self._open(request, raw)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response({"error": {"message": f"engine: {exc!r}"}}, status=503)
        async with reply:
            if reply.status == 400:
                text = await reply.text()
                error = _json_object(text).get("error")
                if isinstance(error, dict):  # a value the engine refuses: in-band, as SGLang
                    return in_band_error(str(error.get("message")))
                return web.Response(status=400, text=text, content_type="application/json")
            return await self._relay(request, reply)

    async def not_sglangs(self, request: web.Request) -> web.Response:
        """A route the embedded engine has and SGLang has not: FastAPI's 404, as SGLang's."""
        return web.json_response({"detail": "Not Found"}, status=404)

    async def join_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.joins.append(body)
        first, last = body["rank_offset"], body["rank_offset"] + self.tp_size - 1
        message = f"recorded by the SGLang double (ranks {first}..{last}); no group was joined"
        return web.json_response({"success": True, "message": message})

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        name, path, pinned = body.get("lora_name"), body.get("lora_path"), body.get("pinned", False)
        if not isinstance(name, str) or not isinstance(path, str) or not isinstance(pinned, bool):
            return validation_error("lora_name and lora_path (strings) and pinned (a bool)")
        return lora_update(*await self.adapters.load(name, path, pinned))

    async def unload_adapter(self, request: web.Request) -> web.Response:
        name = (await _json_body(request)).get("lora_name")
        if not isinstance(name, str):
            return validation_error("lora_name (a string)")
        return lora_update(*await self.adapters.unload(name))

    async def adapter_call(self, path: str, body: dict) -> str | None:
        """Load into or unload from the engine behind: why it failed, or None (also when the
        engine has no such route: the double's registry answers alone)."""
        assert self.http is not None
        try:
            async with self.http.post(f"{self.upstream}{path}", json=body) as reply:
                text = await reply.text()
                if reply.status == 404:
                    return None
                answer = _json_object(text)
                if reply.status < 400 and answer.get("success", True):
                    return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"engine: {exc!r}"
        error = answer.get("error")
        message = answer.get("error_message") or answer.get("message")
        if message is None and isinstance(error, dict):
            message = error.get("message")
        return str(message or error or text)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"generate": self.generate_requests, "joins": self.joins, "lora_paths": self.lora_paths}
        )


class DoubleProcess(ServerProcess):
    """The double as a process in front of ``upstream`` (for tests); ``stats()`` reads its
    counts."""

    name = "sglang double"
    ready_path = "/health"

    def __init__(self, upstream: str, log_path: Path, *flags: str) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "tests.sglang_double", "--model-path", "(upstream)",
            "--port", str(self.port), "--upstream", upstream, *flags,
        ]  # fmt: skip
        super().__init__(command, f"http://127.0.0.1:{self.port}", log_path, cwd=ROOT)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}{STATS_PATH}", timeout=10).json()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang_double", description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int, default=0, help="accepted, unused")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--upstream", help="a running engine to front (default: start one)")
    parser.add_argument("--advertise-context", type=int, default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loaded-loras", type=int, default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument("--lora-eviction-policy", choices=("lru", "fifo"), default="lru")
    args = parser.parse_args(argv)
    if args.enable_lora and not (args.max_lora_rank and args.lora_target_modules):
        parser.error(  # SGLang's start-up check where no --lora-paths sizes the adapter pool
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
            "and --lora-target-modules for LoRA initialization."
        )
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        parser.error("max_loaded_loras should be greater than or equal to max_loras_per_batch")
    return args


def lora_flags(args: argparse.Namespace) -> LoRAFlags:
    return LoRAFlags(
        enabled=args.enable_lora,
        max_loaded=args.max_loaded_loras,
        max_per_batch=args.max_loras_per_batch,
        max_rank=args.max_lora_rank,
        target_modules=args.lora_target_modules,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = None
    upstream = args.upstream
    if upstream is None:
        flags: tuple[str, ...] = ("--weight-version", args.weight_version, "--num-threads", "1")
        if args.max_loaded_loras is not None:  # the double loads one more, then evicts
            flags += ("--max-loaded-loras", str(args.max_loaded_loras + 1))
        engine = EngineProcess(args.model_path, None, *flags).wait_ready()
        upstream = engine.url
    double = Double(
        upstream, args.tp_size, args.context_length, args.advertise_context, lora_flags(args)
    )
    try:
        web.run_app(
            double.app(), host=args.host, port=args.port, print=None, handler_cancellation=True
        )
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
