"""What the proxy costs: chat requests through ``proxrl serve`` vs the same generation sent to the
engine directly, with the trajectory store on, on one machine and in one run.

One embedded engine serves the tiny model; one proxy (``python -m server.cli serve``) is
attached to it and stores every turn in SQLite under a temporary data dir. Each scenario runs
the same requests on both sides, phase after phase (direct, proxy, direct, proxy, ...):

- proxy: httpx ``POST /v1/chat/completions`` with a session's key, one session per client,
  with ``max_tokens`` and a ``seed`` (httpx on both sides: the same client library, so the
  difference is the proxy's);
- direct: httpx ``POST /generate`` to the engine with the body the proxy itself sends
  (``server.proxy.generation.engine_body``): the same prompt ids (the chat template rendered and
  encoded here, checked against the prompt ids the store recorded), the same ``max_new_tokens``
  and ``sampling_seed``. The engine draws a seeded request's samples from its own generator, so
  both sides produce the same tokens and stop at the same EOS: the same work. (OpenAI's API has
  no ``ignore_eos``; the seed makes it unnecessary.) Tokens are counted as each side reports them
  (``usage.completion_tokens``, ``meta_info.completion_tokens``).

Scenarios: 1 client sending requests one after another; N clients at once, each in its own
session; and 1 client streaming (latency is time to the last token). Two more show what a
user of the ``openai`` SDK sees (``AsyncOpenAI`` on the session's ``base_url``/``api_key``,
against the same httpx direct side, so the SDK's own cost is in the difference), streaming and
not. And one calibrates the machine: a bare forwarder (bench/forwarder.py: uvicorn + aiohttp
passing the /generate body through, no framework and no work) in the proxy's place, which is
what any extra Python HTTP hop costs here. Four more send the same conversations through the
other API surfaces (bench/surfaces.py: the Responses API and Anthropic Messages, streaming and
not, with httpx): their proxy CPU per request is held to within 1.2x of Chat Completions' rows
(those two surfaces take no seed, so their samples differ from the direct side's; their token
counts are reported beside). Reported per scenario:
completion tokens/s on both sides (median over rounds) and their ratio (target >= 0.95), median
request latency on both sides (over every request of every round) and the difference (target
< 2 ms at 1 client), and the store's write load: prompt + completion tokens stored during a
proxy phase (read back from ``GET /rl/sessions/{id}``) per second of that phase. That is the
rate the store kept up with, not its capacity: each answer waits for its turn's commit, so the
writes are inside the proxy's latency. Also reported: CPU time per request of the proxy process
(and, in the JSON, of the engine and of this client on each side), read from /proc; on a shared
machine it is steadier than wall time and says what the proxy's cost is made of.

The proxy, the engine and this client share the CPUs. The engine runs ``--engine-threads`` torch
threads (default 1): on a 2-core machine, an engine with 2 OpenMP threads stalls whenever the
proxy or the client takes a core from one of them (a 1-token request's median went from 15 ms
to 300 ms in our runs), which would measure CPU contention rather than the proxy; with a GPU,
the engine's compute does not compete with the proxy at all.

The targets (>= 0.95 of direct throughput, < 2 ms added at 1 client) are checked on the httpx
rows. What it does not measure: several engines, Postgres, multi-turn prompt splicing, tool calls,
logprobs in the answer, or GPUs. Results go to stdout and to bench/results/proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from bench.common import Forwarder, new_sessions, positive_int, process_cpu  # noqa: E402
from bench.surfaces import SURFACES  # noqa: E402
from server.common.processes import EngineProcess, ProxyProcess  # noqa: E402
from server.proxy.generation import SamplingRequest, engine_body  # noqa: E402
from server.text.tokenization import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "proxy.json"
LOG_DIR = ROOT / ".cache" / "bench"
SEED = 0
TEMPERATURE = 1.0
# A request on the tiny model takes well under a second; one that takes this long has stalled.
REQUEST_TIMEOUT_S = 120.0
TARGET_RATIO = 0.95
TARGET_ADDED_MS = 2.0
TARGET_ROWS = ("single", "concurrent", "single_stream")  # httpx on both sides
# The other surfaces' rows: the proxy's CPU per request within this of Chat Completions' (the
# same requests, through the same answer path).
SURFACE_NAMES = {"responses": "Responses API", "messages": "Anthropic Messages"}
TARGET_SURFACE_CPU = 1.2
SYSTEM = "You are a careful assistant. Answer briefly."
WORDS = "apple river stone cloud seven green lamp quiet number table window forty".split()


@dataclass(frozen=True)
class ChatRequest:
    """One chat turn and what the engine sees of it."""

    messages: list[dict[str, str]]
    prompt_ids: list[int]
    seed: int


@dataclass
class PhaseResult:
    """One side of one scenario in one round."""

    seconds: float
    completion_tokens: list[int]  # per request, in (client, request) order
    latencies: list[float]  # seconds, per request, same order
    cpu_seconds: dict[str, float]  # CPU time of the engine, the proxy and this client
    stored_tokens: int = 0  # proxy phases: prompt + completion tokens the store holds for it

    @property
    def tokens_per_second(self) -> float:
        return sum(self.completion_tokens) / self.seconds

    def cpu_ms_per_request(self, process: str) -> float:
        return 1000 * self.cpu_seconds[process] / len(self.latencies)


@dataclass
class Scenario:
    key: str
    label: str
    clients: list[list[ChatRequest]]  # each client's requests, sent one after another
    stream: bool = False
    sdk: bool = False  # the proxy side uses the openai SDK instead of httpx
    forwarder: bool = False  # the bare forwarder stands in for the proxy
    surface: str = "chat"  # the proxy side's API (bench/surfaces.py), with httpx
    direct: list[PhaseResult] = field(default_factory=list)
    proxy: list[PhaseResult] = field(default_factory=list)


@dataclass(frozen=True)
class CpuMeter:
    """CPU seconds used so far by the engine, the proxy, the bare forwarder and this process
    (Linux /proc)."""

    engine_pid: int
    proxy_pid: int
    forwarder_pid: int

    def read(self) -> dict[str, float]:
        return {
            "engine": process_cpu(self.engine_pid),
            "proxy": process_cpu(self.proxy_pid),
            "forwarder": process_cpu(self.forwarder_pid),
            "client": time.process_time(),
        }


def ensure_model() -> Path:
    """proxrl's tiny test model, built once under .cache/ (it is deterministic)."""
    model_dir = ROOT / ".cache" / "models" / "tiny"
    if not (model_dir / "model.safetensors").exists():
        from server.common.tiny_model import create_tiny_model

        create_tiny_model(model_dir, "tiny")
    return model_dir


def make_requests(tokenizer: Tokenizer, rng: random.Random, count: int) -> list[ChatRequest]:
    """Single-turn chats with prompts of ~30..70 tokens, each with its own sampling seed."""
    requests = []
    for _ in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a} + {b}? Context: {filler}."},
        ]
        text = tokenizer.render(messages, add_generation_prompt=True)
        requests.append(ChatRequest(messages, tokenizer.encode(text), rng.randrange(2**31)))
    return requests


def split(requests: list[ChatRequest], clients: int) -> list[list[ChatRequest]]:
    per = len(requests) // clients
    return [requests[i * per : (i + 1) * per] for i in range(clients)]


async def run_clients(
    clients: list[list[ChatRequest]],
    send: Callable[[int, ChatRequest], Awaitable[int]],
    meter: CpuMeter,
) -> PhaseResult:
    """Every client sends its requests one after another, all clients at once."""
    tokens = [[0] * len(c) for c in clients]
    latencies = [[0.0] * len(c) for c in clients]

    async def client(index: int) -> None:
        for j, request in enumerate(clients[index]):
            started = time.perf_counter()
            tokens[index][j] = await send(index, request)
            latencies[index][j] = time.perf_counter() - started

    cpu_before, started = meter.read(), time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(len(clients))))
    seconds, cpu_after = time.perf_counter() - started, meter.read()
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
    return PhaseResult(
        seconds, [n for c in tokens for n in c], [x for c in latencies for x in c], cpu
    )


# --- the two sides ----------------------------------------------------------------------------


def http_client(scenario: Scenario) -> httpx.AsyncClient:
    """The httpx client of a phase, a connection for each of the scenario's clients."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    limits = httpx.Limits(max_connections=len(scenario.clients) + 1)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def direct_phase(
    url: str, scenario: Scenario, max_tokens: int, meter: CpuMeter
) -> PhaseResult:
    """The scenario's requests to ``url``/generate (the engine's, or the bare forwarder's in
    front of it), with the body the proxy would send."""
    async with http_client(scenario) as http:

        async def send(_: int, request: ChatRequest) -> int:
            sampling = SamplingRequest(
                request.prompt_ids, max_tokens, TEMPERATURE, seed=request.seed
            )
            body = engine_body(sampling, [], f"bench-{uuid.uuid4().hex}-0")
            if not scenario.stream:
                reply = await http.post(f"{url}/generate", json=body)
                reply.raise_for_status()
                return reply.json()["meta_info"]["completion_tokens"]
            tokens = 0
            async with http.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
            return tokens

        return await run_clients(scenario.clients, send, meter)


async def proxy_phase(  # noqa: C901  # its senders (httpx, SDK; streamed or not) share setup
    proxy: ProxyProcess, model: str, scenario: Scenario, max_tokens: int, meter: CpuMeter
) -> PhaseResult:
    """The scenario's requests through the proxy, a session per client, with httpx or the
    openai SDK."""
    sessions = await new_sessions(proxy.url, proxy.admin, len(scenario.clients))  # not timed
    http = http_client(scenario)
    sdks = [
        AsyncOpenAI(
            base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        for s in sessions
    ]

    surface = SURFACES[scenario.surface]

    async def send_httpx(index: int, request: ChatRequest) -> int:
        url = sessions[index]["base_url"] + surface.path
        headers = surface.headers(sessions[index]["api_key"])
        body = surface.body(
            model, request.messages, max_tokens, TEMPERATURE, request.seed, scenario.stream
        )
        if not scenario.stream:
            reply = await http.post(url, json=body, headers=headers)
            reply.raise_for_status()
            return surface.tokens(reply.json()) or 0
        tokens = 0
        async with http.stream("POST", url, json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):  # every event parsed, as on the direct side
                    tokens = surface.tokens(json.loads(line[6:])) or tokens
        return tokens

    async def send_sdk(index: int, body: dict) -> int:
        sdk = sdks[index]
        if not scenario.stream:
            answer = await sdk.chat.completions.create(**body)
            return answer.usage.completion_tokens
        chunks = await sdk.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        tokens = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def send(index: int, request: ChatRequest) -> int:
        if not scenario.sdk:
            return await send_httpx(index, request)
        body = {"model": model, "messages": request.messages, "max_tokens": max_tokens}
        body |= {"temperature": TEMPERATURE, "seed": request.seed}
        return await send_sdk(index, body)

    try:
        result = await run_clients(scenario.clients, send, meter)
    finally:
        await http.aclose()
        for sdk in sdks:
            await sdk.close()
    result.stored_tokens = check_stored(proxy, scenario, sessions, result)
    return result


def stored_turns(proxy: ProxyProcess, session_id: str) -> list[dict]:
    """The turns the proxy stored for a session (admin key)."""
    reply = httpx.get(f"{proxy.url}/rl/sessions/{session_id}", headers=proxy.admin, timeout=60)
    reply.raise_for_status()
    return reply.json()["turns"]


def check_stored(
    proxy: ProxyProcess, scenario: Scenario, sessions: list[dict], result: PhaseResult
) -> int:
    """Tokens the store holds for a phase's sessions, after checking every turn is there with
    the prompt ids the direct side used and the completion length the client was told."""
    stored, told = 0, iter(result.completion_tokens)
    for session, requests in zip(sessions, scenario.clients, strict=True):
        turns = stored_turns(proxy, session["session_id"])
        if len(turns) != len(requests):
            raise RuntimeError(f"{len(turns)} turns stored for {len(requests)} requests")
        for turn, request in zip(turns, requests, strict=True):
            if turn["prompt_ids"] != request.prompt_ids:
                raise RuntimeError("the proxy's prompt ids differ from the direct side's")
            if len(turn["completion_ids"]) != next(told):
                raise RuntimeError("a stored completion differs from the usage the client got")
            stored += len(turn["prompt_ids"]) + len(turn["completion_ids"])
    return stored


# --- the run ----------------------------------------------------------------------------------


def timed(label: str, run: Callable[[], PhaseResult]) -> PhaseResult:
    """One phase, with a progress line."""
    print(f"  {label} ...", end="", flush=True)
    result = run()
    print(f" {result.seconds:.2f}s, {sum(result.completion_tokens)} tokens", flush=True)
    return result


def measure(
    engine: EngineProcess,
    proxy: ProxyProcess,
    forwarder: Forwarder,
    model: str,
    scenarios: list[Scenario],
    args,
) -> None:
    meter = CpuMeter(engine.process.pid, proxy.process.pid, forwarder.process.pid)

    def direct(s: Scenario) -> PhaseResult:
        return asyncio.run(direct_phase(engine.url, s, args.max_tokens, meter))

    def through_proxy(s: Scenario) -> PhaseResult:
        if s.forwarder:
            return asyncio.run(direct_phase(forwarder.url, s, args.max_tokens, meter))
        return asyncio.run(proxy_phase(proxy, model, s, args.max_tokens, meter))

    print("warm-up")
    for scenario in scenarios:
        first = [c[:3] for c in scenario.clients]
        short = dataclasses.replace(scenario, clients=first, direct=[], proxy=[])
        timed(f"direct {scenario.label}", lambda s=short: direct(s))
        timed(f"proxy  {scenario.label}", lambda s=short: through_proxy(s))
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}/{args.rounds}")
        for scenario in scenarios:
            scenario.direct.append(timed(f"direct {scenario.label}", lambda s=scenario: direct(s)))
            scenario.proxy.append(
                timed(f"proxy  {scenario.label}", lambda s=scenario: through_proxy(s))
            )


def summarize(scenario: Scenario) -> dict:
    """Medians over rounds (throughput) and over every request of every round (latency)."""
    hop = "forwarder" if scenario.forwarder else "proxy"
    direct_tps = statistics.median(r.tokens_per_second for r in scenario.direct)
    proxy_tps = statistics.median(r.tokens_per_second for r in scenario.proxy)
    direct_ms = 1000 * statistics.median(x for r in scenario.direct for x in r.latencies)
    proxy_ms = 1000 * statistics.median(x for r in scenario.proxy for x in r.latencies)
    requests = sum(len(r.latencies) for r in scenario.proxy)
    same = sum(
        a == b
        for d, p in zip(scenario.direct, scenario.proxy, strict=True)
        for a, b in zip(d.completion_tokens, p.completion_tokens, strict=True)
    )
    return {
        "clients": len(scenario.clients),
        "requests_per_client": len(scenario.clients[0]),
        "stream": scenario.stream,
        "client": "openai SDK" if scenario.sdk else "httpx",
        "surface": scenario.surface,
        "hop": "bare forwarder" if scenario.forwarder else "proxrl serve",
        "completion_tokens_per_round": statistics.median(
            sum(r.completion_tokens) for r in scenario.proxy
        ),
        "requests_with_equal_token_counts": f"{same}/{requests}",
        "direct_tok_s": direct_tps,
        "proxy_tok_s": proxy_tps,
        "ratio": proxy_tps / direct_tps,
        "direct_p50_ms": direct_ms,
        "proxy_p50_ms": proxy_ms,
        "added_ms": proxy_ms - direct_ms,
        "stored_tok_s": statistics.median(r.stored_tokens / r.seconds for r in scenario.proxy),
        # CPU per request, median of rounds: where the proxy's cost goes, less noisy than wall time
        "proxy_cpu_ms_per_request": cpu_ms(scenario.proxy, hop),
        "engine_cpu_ms_per_request": {
            "direct": cpu_ms(scenario.direct, "engine"),
            "proxy": cpu_ms(scenario.proxy, "engine"),
        },
        "client_cpu_ms_per_request": {
            "direct": cpu_ms(scenario.direct, "client"),
            "proxy": cpu_ms(scenario.proxy, "client"),
        },
    }


def cpu_ms(results: list[PhaseResult], process: str) -> float:
    return statistics.median(r.cpu_ms_per_request(process) for r in results)


def markdown_table(rows: dict[str, dict], labels: dict[str, str]) -> str:
    lines = [
        "| scenario | tokens | direct tok/s | proxy tok/s | ratio | direct p50 ms "
        "| proxy p50 ms | added ms | stored tok/s | proxy CPU ms/req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in rows.items():
        lines.append(
            f"| {labels[key]} | {row['completion_tokens_per_round']:.0f} "
            f"| {row['direct_tok_s']:.0f} | {row['proxy_tok_s']:.0f} | {row['ratio']:.3f} "
            f"| {row['direct_p50_ms']:.1f} | {row['proxy_p50_ms']:.1f} | {row['added_ms']:+.1f} "
            f"| {_stored(row)} | {row['proxy_cpu_ms_per_request']:.1f} |"
        )
    return "\n".join(lines)


def _stored(row: dict) -> str:
    return "-" if row["hop"] == "bare forwarder" else f"{row['stored_tok_s']:.0f}"


def verdicts(rows: dict[str, dict]) -> list[str]:
    out = []
    for key in TARGET_ROWS:
        row = rows[key]
        ok = row["ratio"] >= TARGET_RATIO
        out.append(f"{key}: ratio {row['ratio']:.3f} {'meets' if ok else 'MISSES'} >= 0.95")
    single, floor = rows["single"], rows["single_forwarder"]
    ok = single["added_ms"] < TARGET_ADDED_MS
    out.append(f"single: {single['added_ms']:+.2f} ms added {'meets' if ok else 'MISSES'} < 2 ms")
    floor_cpu, own = floor["proxy_cpu_ms_per_request"], single["added_ms"] - floor["added_ms"]
    out.append(
        f"a bare forwarder adds {floor['added_ms']:+.2f} ms ({floor_cpu:.1f} ms CPU per request) "
        f"on this machine: the proxy's own work adds {own:+.2f} ms"
    )
    return out + surface_verdicts(rows)


def surface_verdicts(rows: dict[str, dict]) -> list[str]:
    """Each other surface's proxy CPU per request against Chat Completions', streamed or not."""
    out = []
    for surface in SURFACE_NAMES:
        for chat_key in ("single", "single_stream"):
            key = f"{chat_key}_{surface}"
            if key not in rows:
                continue
            chat, row = rows[chat_key], rows[key]
            ratio = row["proxy_cpu_ms_per_request"] / chat["proxy_cpu_ms_per_request"]
            ok = ratio <= TARGET_SURFACE_CPU
            tokens = row["completion_tokens_per_round"]
            chat_tokens = chat["completion_tokens_per_round"]
            out.append(
                f"{key}: proxy CPU {row['proxy_cpu_ms_per_request']:.2f} ms/req vs chat "
                f"{chat['proxy_cpu_ms_per_request']:.2f} = {ratio:.2f}x "
                f"{'meets' if ok else 'MISSES'} <= {TARGET_SURFACE_CPU}x "
                f"({tokens:.0f} vs {chat_tokens:.0f} tokens per round)"
            )
    return out


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def save(report: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=5,
        help="Rounds of (direct, proxy) per scenario after a warm-up; medians are reported "
        "(default: 5).",
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=32,
        help="Concurrent clients in the concurrent scenario, one session each (default: 32).",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=30,
        help="Requests the single client sends one after another per phase, streaming or "
        "not (default: 30).",
    )
    parser.add_argument(
        "--requests-per-client",
        type=positive_int,
        default=4,
        help="Requests each of the concurrent clients sends per phase (default: 4).",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=32,
        help="max_tokens of every request; a request ends sooner only at EOS, on both sides "
        "alike (default: 32).",
    )
    parser.add_argument(
        "--engine-threads",
        type=positive_int,
        default=1,
        help="torch threads of the engine; the proxy and this client need the other cores "
        "(default: 1).",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # A SIGTERM (a timeout, say) unwinds the with-blocks, so the engine and the proxy stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    host = machine()
    print(f"machine: {host['cpu_count']} CPUs, Python {host['python']}, {host['platform']}")
    model_dir = ensure_model()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    rng = random.Random(SEED)

    def one_client(key: str, label: str, **flags: Any) -> Scenario:
        return Scenario(key, label, [make_requests(tokenizer, rng, args.requests)], **flags)

    single = one_client("single", "1 client")  # requests drawn in this order, from one seed
    many = make_requests(tokenizer, rng, args.clients * args.requests_per_client)
    scenarios = [
        single,
        Scenario("concurrent", f"{args.clients} clients", split(many, args.clients)),
        one_client("single_stream", "1 client, streaming", stream=True),
        one_client("single_sdk", "1 client, openai SDK", sdk=True),
        one_client("single_stream_sdk", "1 client, streaming, openai SDK", stream=True, sdk=True),
        one_client("single_forwarder", "1 client, bare forwarder", forwarder=True),
        *(
            one_client(f"{key}_{surface}", f"{label}, {SURFACE_NAMES[surface]}", **flags)
            for surface in SURFACE_NAMES
            for key, label, flags in [
                ("single", "1 client", {"surface": surface}),
                ("single_stream", "1 client, streaming", {"surface": surface, "stream": True}),
            ]
        ),
    ]
    print(
        f"model: tiny; max_tokens {args.max_tokens}; 1 client x {args.requests} requests, "
        f"{args.clients} clients x {args.requests_per_client} requests; engine with "
        f"{args.engine_threads} torch thread(s)"
    )

    LOG_DIR.mkdir(parents=True, exist_ok=True)
    print("starting the engine and the proxy ...", flush=True)
    engine_log = LOG_DIR / "proxy-bench-engine.log"
    with (
        tempfile.TemporaryDirectory(prefix="proxrl-bench-") as data_dir,
        EngineProcess(
            model_dir,
            engine_log,
            "--incremental-streaming-output",
            *("--num-threads", str(args.engine_threads)),
        ) as engine,
        ProxyProcess(
            model_dir, Path(data_dir), secrets.token_hex(16), "--engines", engine.url
        ) as proxy,
        Forwarder(engine.url, LOG_DIR / "proxy-bench-forwarder.log") as forwarder,
    ):
        measure(engine, proxy, forwarder, model_dir.name, scenarios, args)

    rows = {s.key: summarize(s) for s in scenarios}
    table = markdown_table(rows, {s.key: s.label for s in scenarios})
    total = time.perf_counter() - started
    print(f"\n{table}\n")
    print(
        "tok/s: completion tokens per second, median of rounds; p50: median request latency "
        "(streaming: to the last token) over all rounds; ratio = proxy / direct, measured in "
        "this run; stored tok/s: prompt + completion tokens stored per second of proxy phase; "
        "proxy CPU ms/req: CPU time of the proxy process (on its row, the bare forwarder's) per "
        "request, median of rounds"
    )
    for line in verdicts(rows):
        print(line)
    print(f"total {total:.0f}s")
    save(
        {
            "machine": host,
            "args": vars(args),
            "table": table,
            "rows": rows,
            "phases": {
                s.key: {
                    side: [
                        {
                            "seconds": r.seconds,
                            "completion_tokens": sum(r.completion_tokens),
                            "stored_tokens": r.stored_tokens,
                            "p50_ms": 1000 * statistics.median(r.latencies),
                            "cpu_seconds": r.cpu_seconds,
                        }
                        for r in results
                    ]
                    for side, results in (("direct", s.direct), ("proxy", s.proxy))
                }
                for s in scenarios
            },
            "total_seconds": total,
        }
    )


if __name__ == "__main__":
    main()
