"""What the proxy's hot path costs in CPU: ``proxrl serve`` against a bare forwarder in front of
the same stub engine, streamed and not, ratios from one run.

One stub engine (bench/stub_engine.py: the SGLang protocol, no model, ``--tokens`` tokens per
answer) serves both sides; ``proxrl serve --engines STUB`` stores every turn in SQLite under a
temporary data dir, and the bare forwarder (bench/forwarder.py: uvicorn + aiohttp passing the
``/generate`` body through, a stream block by block) stands beside it. This process is the load
generator: ``--clients`` aiohttp clients at once, each sending its share of ``--requests``
single-turn chats one after another (the proxy: Chat Completions in a session of its own per
client, with a seed; the forwarder: ``/generate`` with the body the proxy sends for the same
prompt). The four phases (forwarder, proxy; non-streamed, streamed) run in turn, ``--rounds``
times after a warm-up. Each phase's CPU is the server process's user + system time from /proc
over the phase; its rate is requests over the phase's wall time.

Reported, medians of rounds: CPU ms per request of each server, requests/s, CPU per streamed
token (a streamed request's CPU over its tokens), and the ratios the issue sets targets for:
proxy / forwarder non-streamed (target <= 2x) and proxy streamed / proxy non-streamed (target
<= 1.5x). The stub and this client share the machine's cores with the server measured, so
requests/s says how fast this machine went, CPU per request what a request costs. /proc counts
CPU in clock ticks (10 ms): a phase of N requests reads to within 10 / N ms per request.
Results go to stdout and bench/results/proxy_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp  # noqa: E402

from bench.common import (  # noqa: E402
    Forwarder,
    StubEngine,
    new_sessions,
    per_client,
    positive_int,
    process_cpu,
)
from bench.proxy import ChatRequest, ensure_model, make_requests  # noqa: E402
from server.common.processes import ProxyProcess, ServerProcess  # noqa: E402
from server.proxy.generation import SamplingRequest, engine_body  # noqa: E402
from server.text.tokenization import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "proxy_cost.json"
LOG_DIR = ROOT / ".cache" / "bench"
SEED = 0
TIMEOUT = aiohttp.ClientTimeout(total=120.0, connect=10.0)
TARGET_VS_FORWARDER = 2.0  # proxy CPU per request over the forwarder's, non-streamed
TARGET_STREAMED = 1.5  # the proxy's streamed CPU per request over its non-streamed


@dataclass(frozen=True)
class Measured:
    """One phase: its wall time, requests, completion tokens, and CPU seconds by process."""

    seconds: float
    requests: int
    tokens: int
    cpu: dict[str, float]


@dataclass
class Phase:
    side: str  # "proxy", "forwarder", or "baseline" (a proxy from another tree)
    stream: bool
    rounds: list[Measured] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.side}_{'streamed' if self.stream else 'plain'}"

    def median(self, value) -> float:
        return statistics.median(value(m) for m in self.rounds)

    def summary(self) -> dict:
        server = self.side
        return {
            "side": self.side,
            "stream": self.stream,
            "requests_per_round": self.rounds[0].requests,
            "tokens_per_request": self.median(lambda m: m.tokens / m.requests),
            "cpu_ms_per_request": self.median(lambda m: 1000 * m.cpu[server] / m.requests),
            "cpu_ms_per_token": self.median(lambda m: 1000 * m.cpu[server] / m.tokens),
            "requests_per_s": self.median(lambda m: m.requests / m.seconds),
            "engine_cpu_ms_per_request": self.median(lambda m: 1000 * m.cpu["engine"] / m.requests),
            "client_cpu_ms_per_request": self.median(lambda m: 1000 * m.cpu["client"] / m.requests),
        }


async def proxy_send(
    http: aiohttp.ClientSession, session: dict, request: ChatRequest, stream: bool, tokens: int
) -> int:
    """One chat through the proxy; the completion tokens it reports."""
    body: dict = {"model": "tiny", "messages": request.messages, "max_tokens": 2 * tokens}
    body |= {"temperature": 1.0, "seed": request.seed}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    url = f"{session['base_url']}/chat/completions"
    async with http.post(url, json=body, headers=headers) as reply:
        reply.raise_for_status()
        if not stream:
            return (await reply.json())["usage"]["completion_tokens"]
        counted = 0
        async for line in reply.content:
            if line.startswith(b"data: {") and b'"usage": {' in line:
                usage = json.loads(line[6:]).get("usage")
                counted = usage["completion_tokens"] if usage else counted
        return counted


async def forwarder_send(
    http: aiohttp.ClientSession, url: str, request: ChatRequest, stream: bool, tokens: int
) -> int:
    """The body the proxy would send for the same chat, to the forwarder's /generate."""
    sampling = SamplingRequest(request.prompt_ids, 2 * tokens, 1.0, seed=request.seed)
    body = engine_body(sampling, [], f"bench-{uuid.uuid4().hex}-0") | {"stream": stream}
    async with http.post(f"{url}/generate", json=body) as reply:
        reply.raise_for_status()
        if not stream:
            return (await reply.json())["meta_info"]["completion_tokens"]
        counted = 0
        async for line in reply.content:
            if line.startswith(b"data: {"):
                counted = json.loads(line[6:])["meta_info"]["completion_tokens"]
        return counted


async def run_phase(
    phase: Phase,
    requests: list[list[ChatRequest]],
    servers: dict[str, ServerProcess],
    admin: dict[str, str],
    tokens: int,
) -> Measured:
    """Every client's requests, all clients at once, through the phase's side."""
    through = servers.get(phase.side)
    proxied = phase.side != "forwarder"
    sessions = await new_sessions(through.url, admin, len(requests)) if proxied else []
    connector = aiohttp.TCPConnector(limit=len(requests) + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as http:

        async def client(index: int) -> int:
            got = 0
            for request in requests[index]:
                if proxied:
                    got += await proxy_send(http, sessions[index], request, phase.stream, tokens)
                else:
                    url = servers["forwarder"].url
                    got += await forwarder_send(http, url, request, phase.stream, tokens)
            return got

        before, started = _cpu(servers), time.perf_counter()
        counts = await asyncio.gather(*(client(i) for i in range(len(requests))))
        seconds, after = time.perf_counter() - started, _cpu(servers)
    cpu = {name: after[name] - before[name] for name in before}
    return Measured(seconds, sum(len(r) for r in requests), sum(counts), cpu)


def _cpu(servers: dict[str, ServerProcess]) -> dict[str, float]:
    cpu = {name: process_cpu(server.process.pid) for name, server in servers.items()}
    return cpu | {"client": time.process_time()}


def markdown(rows: dict[str, dict]) -> str:
    lines = [
        "| side | streamed | tokens/req | CPU ms/req | CPU ms/token | req/s | stub CPU ms/req |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows.values():
        lines.append(
            f"| {row['side']} | {'yes' if row['stream'] else 'no'} "
            f"| {row['tokens_per_request']:.1f} | {row['cpu_ms_per_request']:.2f} "
            f"| {row['cpu_ms_per_token']:.3f} | {row['requests_per_s']:.0f} "
            f"| {row['engine_cpu_ms_per_request']:.2f} |"
        )
    return "\n".join(lines)


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    def cpu(key: str) -> float:
        return rows[key]["cpu_ms_per_request"]

    found = {}
    for side in ("proxy", "baseline"):
        if f"{side}_plain" not in rows:
            continue
        found |= {
            f"{side}_vs_forwarder_plain": cpu(f"{side}_plain") / cpu("forwarder_plain"),
            f"{side}_vs_forwarder_streamed": cpu(f"{side}_streamed") / cpu("forwarder_streamed"),
            f"{side}_streamed_vs_plain": cpu(f"{side}_streamed") / cpu(f"{side}_plain"),
        }
    return found | {
        "forwarder_streamed_vs_plain": cpu("forwarder_streamed") / cpu("forwarder_plain")
    }


def verdicts(found: dict[str, float]) -> list[str]:
    out = []
    for key, target in (
        ("proxy_vs_forwarder_plain", TARGET_VS_FORWARDER),
        ("proxy_streamed_vs_plain", TARGET_STREAMED),
    ):
        if key not in found:
            continue
        ok = found[key] <= target
        out.append(f"{key}: {found[key]:.2f}x {'meets' if ok else 'MISSES'} <= {target}x")
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=800,
        help="Requests per phase, split between the clients (default: 800).",
    )
    parser.add_argument(
        "--clients", type=positive_int, default=8, help="Concurrent clients (default: 8)."
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="Rounds of the four phases after a warm-up; medians are reported (default: 3).",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=16,
        help="Tokens per answer, from the stub engine (default: 16).",
    )
    parser.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=1.0,
        help="The stub's pause between a stream's chunks, so each chunk arrives on its own as "
        "from a real engine (default: 1).",
    )
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        help="The proxy's --stream-interval-ms, its streams' latency bound (default: the "
        "server's); the baseline keeps its own.",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="A checkout of proxrl (git worktree add --detach DIR COMMIT) whose proxy runs beside "
        "this one's, phases interleaved: before and after a change, in one run.",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    model_dir = ensure_model()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    each = max(args.requests // args.clients, 1)
    chats = make_requests(tokenizer, random.Random(SEED), each * args.clients)
    clients = per_client(chats, args.clients)
    warm = [c[: max(each // 10, 2)] for c in clients]
    sides = ("forwarder", "proxy", *(("baseline",) if args.baseline else ()))
    phases = [Phase(side, stream) for stream in (False, True) for side in sides]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    admin_key = secrets.token_hex(16)
    interval = (
        ()
        if args.stream_interval_ms is None
        else ("--stream-interval-ms", str(args.stream_interval_ms))
    )
    with (
        tempfile.TemporaryDirectory(prefix="proxrl-bench-") as data_dir,
        StubEngine(
            model_dir, LOG_DIR / "proxy-cost-stub.log", args.tokens, args.chunk_interval_ms
        ) as stub,
        ProxyProcess(
            model_dir, Path(data_dir) / "proxy", admin_key, "--engines", stub.url, *interval
        ) as proxy,
        Forwarder(stub.url, LOG_DIR / "proxy-cost-forwarder.log") as forwarder,
        contextlib.ExitStack() as stack,
    ):
        servers: dict[str, ServerProcess] = {"proxy": proxy, "forwarder": forwarder, "engine": stub}
        if args.baseline:
            baseline = ProxyProcess(
                model_dir, Path(data_dir) / "baseline", admin_key, "--engines", stub.url,
                cwd=args.baseline,
            )  # fmt: skip
            servers["baseline"] = stack.enter_context(baseline)
        for round_ in range(args.rounds + 1):
            print("warm-up" if round_ == 0 else f"round {round_}/{args.rounds}", flush=True)
            for phase in phases:
                measured = asyncio.run(
                    run_phase(phase, warm if round_ == 0 else clients, servers, proxy.admin,
                              args.tokens)
                )  # fmt: skip
                if round_ > 0:
                    phase.rounds.append(measured)
                server_ms = 1000 * measured.cpu[phase.side] / measured.requests
                print(
                    f"  {phase.key}: {measured.requests / measured.seconds:.0f} req/s, "
                    f"{server_ms:.2f} ms CPU/req",
                    flush=True,
                )
    rows = {phase.key: phase.summary() for phase in phases}
    found = ratios(rows)
    table = markdown(rows)
    print(f"\n{table}\n")
    for key, value in found.items():
        print(f"{key}: {value:.2f}x")
    for line in verdicts(found):
        print(line)
    total = time.perf_counter() - started
    print(f"total {total:.0f}s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "args": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        "rows": rows,
        "ratios": found,
        "table": table,
        "rounds": {p.key: [vars(m) for m in p.rounds] for p in phases},
        "total_seconds": total,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
