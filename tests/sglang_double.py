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
* ``/init_weights_update_group``: an engine of tensor-parallel size t joins the group as ranks
  ``rank_offset .. rank_offset + t - 1`` ("Ranks under tensor parallelism"). The engine behind the
  double holds one rank, so the double cannot take part in a real group of that size: it records the
  request (see ``GET /_double/stats``) and answers success without joining.

Its command line takes the flags proxrl passes to ``python -m sglang.launch_server``
(``--model-path``, ``--host``, ``--port``, ``--tp-size``, ``--base-gpu-id``, ``--weight-version``,
``--context-length``), so ``proxrl serve --engine sglang --sglang-module tests.sglang_double``
can launch it. With ``--upstream URL`` it fronts a running engine; without, it starts an embedded
engine of its own on the model (stopped with it). Everything else is passed through unchanged.
``GET /_double/stats`` counts the ``/generate`` requests it received and lists the weight-group
joins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Double:
    def __init__(
        self, upstream: str, tp_size: int, context_length: int | None, advertise: int | None
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.tp_size = tp_size
        self.context_length = context_length
        self.advertise = advertise
        self.generate_requests = 0
        self.joins: list[dict] = []
        self.http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.cleanup_ctx.append(self._session)
        app.router.add_get(STATS_PATH, self.stats)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_post("/init_weights_update_group", self.join_group)
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
        for card in listing.get("data", []):
            if self.advertise == 0:
                card.pop("max_model_len", None)
            elif self.advertise is not None:
                card["max_model_len"] = self.advertise
        return web.json_response(listing)

    async def generate(self, request: web.Request):
        self.generate_requests += 1
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
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

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"generate": self.generate_requests, "joins": self.joins})


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = None
    upstream = args.upstream
    if upstream is None:
        flags = ("--weight-version", args.weight_version, "--num-threads", "1")
        engine = EngineProcess(args.model_path, None, *flags).wait_ready()
        upstream = engine.url
    double = Double(upstream, args.tp_size, args.context_length, args.advertise_context)
    try:
        web.run_app(
            double.app(), host=args.host, port=args.port, print=None, handler_cancellation=True
        )
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
