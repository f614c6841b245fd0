"""What a LoRA run's publish costs against a full-weights publish, under streaming traffic.

One run, two kinds of publish, each against its own live ``proxrl serve`` (its embedded engine)
on the same model, both up side by side: full weights and adapters cannot share engines (409
``engines_shared``). Their publishes are taken in turns (full then adapter, then adapter then
full, ...; only the publishing server has traffic), so a burst of load from other processes
falls on both kinds rather than on one whole phase.

- full weights: the default run publishes ``--publishes`` new versions with
  ``POST /admin/weights {"model_path"}``, each the model's weights perturbed and written by the
  trainer's ``write_model_dir``;
- adapters: a new run publishes ``--publishes`` adapters with
  ``POST /admin/weights {"run_id", "adapter_path"}``, each written by the trainer's
  ``write_adapter_dir`` (the trainer's default ``lora`` section: rank 8 on every Linear of the
  decoder layers; A and B random, B non-zero, so each version changes what is sampled).

Every publish (after one warm-up publish of each kind, not counted) goes out once ``--streams``
clients, each in its own session of the publishing run, are all mid-answer (streamed chat
completions through the ``openai`` SDK, one after another); they finish their answers after it.
Per publish this keeps: the POST's wall time as this process saw it; the engines' pause (the
answer's ``pause_seconds``: engines paused, in-flight requests aborted and resubmitted by the
proxy, weights loaded, engines resumed; 0 for an adapter, loaded beside the running requests);
the bytes the publish moves (the directory's size: what the trainer writes and each engine
reads); the trainer-side write time; and the streams' worst gap between two consecutive content
chunks where that gap overlaps the POST (the proxy may coalesce tokens into one chunk, so a
chunk gap is at least a token gap), beside the median chunk gap of the same answers. A
kind's figure is the median over its publishes; the ratios are adapter / full from this one run (the
machine is shared and noisy: only ratios from the same run mean anything). Every answer must
end with a finish reason, and each publish must answer the next version.

What it does not measure: several engines (the publish's wall time grows with them for both
kinds), SGLang engines, a cold disk, the trainer's own save (``save_pretrained`` vs gathering a
sharded state), or how many adapters an engine holds at once. Results go to stdout and to
bench/results/lora_swap.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import torch  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench.common import new_sessions, positive_int  # noqa: E402
from bench.trainer import PERTURBATION, ensure_model, publish_while_streaming  # noqa: E402
from server.common.processes import ProxyProcess  # noqa: E402
from trainer.config import LoraConfig  # noqa: E402
from trainer.model import adapter_state, output_embedding_name, with_lora  # noqa: E402
from trainer.worker import write_adapter_dir, write_model_dir  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "lora_swap.json"
SEED = 0
ADAPTER_SCALE = 0.05  # A and B entries: the adapter moves the logits without saturating them
REQUEST_TIMEOUT_S = 120.0  # a request on the tiny model takes a second or two
KINDS = ("full", "adapter")


@dataclass
class Answer:
    """One streamed chat completion: when each content chunk arrived, and how it ended."""

    chunks: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Publish:
    """One publish under streaming clients."""

    wall_s: float
    pause_s: float
    version: int
    window: tuple[float, float]  # when the POST went out and its answer came back
    answers: list[Answer]  # every client's, in the order they ran

    def worst_gap_s(self) -> float:
        """The longest gap between consecutive chunks of one answer that overlaps the POST."""
        sent, answered = self.window
        return max(
            (
                b - a
                for answer in self.answers
                for a, b in pairs(answer)
                if b >= sent and a <= answered
            ),
            default=0.0,
        )

    def median_gap_s(self) -> float:
        return statistics.median(b - a for answer in self.answers for a, b in pairs(answer))


def pairs(answer: Answer) -> list[tuple[float, float]]:
    return list(zip(answer.chunks, answer.chunks[1:], strict=False))


# --- what is published ---------------------------------------------------------------------


def write_adapters(model_dir: Path, out: Path, count: int) -> tuple[list[Path], list[float]]:
    """``count`` adapters as a LoRA run with the default ``lora`` section publishes them, and
    the seconds each took to write."""
    model = with_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig())
    generator = torch.Generator().manual_seed(SEED)
    dirs, seconds = [], []
    for version in range(count):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * ADAPTER_SCALE)
        dirs.append(out / f"adapter-{version}")
        started = time.perf_counter()
        state = adapter_state(model, model.state_dict())
        write_adapter_dir(state, model.peft_config["default"], model_dir, dirs[-1])
        seconds.append(time.perf_counter() - started)
    return dirs, seconds


def write_full(model_dir: Path, out: Path, count: int) -> tuple[list[Path], list[float]]:
    """``count`` full-weight versions (every weight moved by noise, as ``bench/trainer.py``
    makes them), and the seconds each took to write."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied_name = output_embedding_name(model)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    generator = torch.Generator().manual_seed(SEED)
    dirs, seconds = [], []
    for version in range(count):
        noisy = {
            n: t + PERTURBATION * torch.randn(t.shape, generator=generator)
            for n, t in state.items()
        }
        dirs.append(out / f"version-{version}")
        started = time.perf_counter()
        write_model_dir(noisy, model_dir, dirs[-1], tied_name)
        seconds.append(time.perf_counter() - started)
    return dirs, seconds


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- streaming clients and one publish -----------------------------------------------------


async def stream_until(
    sdk: AsyncOpenAI,
    model: str,
    seed: int,
    max_tokens: int,
    mid: asyncio.Event,
    stop: asyncio.Event,
) -> list[Answer]:
    """One client: streamed answers one after another until ``stop``; ``mid`` set mid-answer."""
    answers = []
    while not stop.is_set():
        answer = Answer()
        chunks = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count with me: {seed}, {seed + 1},"}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            stream=True,
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                answer.chunks.append(time.perf_counter())
                mid.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                answer.finish_reason = chunk.choices[0].finish_reason
        mid.clear()
        if answer.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"an answer ended without a finish reason: {answer}")
        answers.append(answer)
        seed += 1
    return answers


async def publish_under_streams(
    proxy: ProxyProcess, sessions: list[dict], model: str, body: dict, seed: int, max_tokens: int
) -> Publish:
    """Clients streaming; ``body`` POSTed to /admin/weights once all are mid-answer."""
    sdks = [
        AsyncOpenAI(
            base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        for s in sessions
    ]

    def stream(index: int, mid: asyncio.Event, stop: asyncio.Event) -> Awaitable[list[Answer]]:
        return stream_until(sdks[index], model, seed + 1000 * index, max_tokens, mid, stop)

    try:
        answer, published, answers = await publish_while_streaming(proxy, stream, len(sdks), body)
    finally:
        for sdk in sdks:
            await sdk.close()
    sent, answered = published
    return Publish(
        answered - sent,
        answer["pause_seconds"],
        answer["policy_version"],
        published,
        [a for client in answers for a in client],
    )


def new_run(proxy: ProxyProcess) -> str:
    reply = httpx.post(
        f"{proxy.url}/rl/runs", headers=proxy.admin, timeout=60,
        json={"name": "lora-swap-bench", "config": {}},
    )  # fmt: skip
    reply.raise_for_status()
    return reply.json()["id"]


# --- one kind, its own server ---------------------------------------------------------------


@dataclass
class Lane:
    """One kind of publish on its own ``proxrl serve``: what it publishes, and what it measured."""

    kind: str  # "full" or "adapter"
    proxy: ProxyProcess
    run_id: str | None  # the adapter lane's run; the full lane publishes the default run
    sessions: list[dict]
    paths: list[Path]  # one per publish, the warm-up's first
    write_seconds: list[float]
    publishes: list[Publish] = field(default_factory=list)

    def body(self, path: Path) -> dict:
        if self.run_id is None:
            return {"model_path": str(path)}
        return {"run_id": self.run_id, "adapter_path": str(path)}


def open_lane(kind: str, model_dir: Path, tmp: Path, args, stack: ExitStack) -> Lane:
    """The versions of ``kind`` written, its server started (closed with ``stack``), its
    streaming sessions made."""
    write = write_adapters if kind == "adapter" else write_full
    paths, write_seconds = write(model_dir, tmp / kind, args.publishes + 1)
    print(f"{kind}: starting a proxy (with its engine) ...", flush=True)
    proxy = stack.enter_context(
        ProxyProcess(model_dir, tmp / f"data-{kind}", secrets.token_hex(16))
    )
    run_id = new_run(proxy) if kind == "adapter" else None
    sessions = asyncio.run(new_sessions(proxy.url, proxy.admin, args.streams, run_id))
    return Lane(kind, proxy, run_id, sessions, paths, write_seconds)


def publish_next(lane: Lane, model: str, args) -> Publish:
    """The lane's next version published under its streams; it must answer that version."""
    index = len(lane.publishes)
    label = "warm-up" if index == 0 else f"publish {index}/{args.publishes}"
    print(f"  {lane.kind} {label} under {args.streams} streams ...", end="", flush=True)
    publish = asyncio.run(
        publish_under_streams(
            lane.proxy,
            lane.sessions,
            model,
            lane.body(lane.paths[index]),
            SEED + 100_000 * index,
            args.max_tokens,
        )
    )
    if publish.version != index + 1:
        raise RuntimeError(f"{lane.kind} publish {index} answered version {publish.version}")
    print(
        f" wall {1000 * publish.wall_s:.1f} ms, pause {1000 * publish.pause_s:.1f} ms, "
        f"worst gap {1000 * publish.worst_gap_s():.1f} ms",
        flush=True,
    )
    lane.publishes.append(publish)
    return publish


def summary(lane: Lane) -> dict:
    """Medians over the measured publishes (the warm-up left out), and each one's figures."""
    measured = lane.publishes[1:]
    return {
        "publishes": len(measured),
        "bytes": directory_bytes(lane.paths[0]),
        "write_s": statistics.median(lane.write_seconds[1:]),
        "wall_s": statistics.median(p.wall_s for p in measured),
        "pause_s": statistics.median(p.pause_s for p in measured),
        "worst_gap_s": statistics.median(p.worst_gap_s() for p in measured),
        "median_gap_s": statistics.median(p.median_gap_s() for p in measured),
        "each": [
            {"wall_s": p.wall_s, "pause_s": p.pause_s, "worst_gap_s": p.worst_gap_s()}
            for p in measured
        ],
        "answers": sum(len(p.answers) for p in lane.publishes),
    }


def measure(model_dir: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """Both servers up side by side; their publishes taken in turns (full, adapter, then
    adapter, full, ...), so a burst of load from other processes falls on both kinds rather
    than on one whole phase. Only the publishing lane streams."""
    with tempfile.TemporaryDirectory(prefix="proxrl-lora-swap-") as tmp, ExitStack() as stack:
        lanes = [open_lane(kind, model_dir, Path(tmp), args, stack) for kind in KINDS]
        for index in range(args.publishes + 1):
            for lane in lanes if index % 2 == 0 else lanes[::-1]:
                publish_next(lane, model_dir.name, args)
        return summary(lanes[0]), summary(lanes[1])


# --- the run --------------------------------------------------------------------------------

ROWS = (  # (label, key, unit scale, unit)
    ("POST /admin/weights wall time", "wall_s", 1000, "ms"),
    ("engine pause (`pause_seconds`)", "pause_s", 1000, "ms"),
    ("bytes moved (the directory)", "bytes", 1e-6, "MB"),
    ("written by the trainer's writer", "write_s", 1000, "ms"),
    ("worst chunk gap across the publish", "worst_gap_s", 1000, "ms"),
    ("median chunk gap (same answers)", "median_gap_s", 1000, "ms"),
)


def ratio(adapter: float, full: float) -> float:
    return adapter / full if full else float("nan")


def markdown_table(full: dict, adapter: dict) -> str:
    lines = [
        "| per publish (median) | full weights | adapter | adapter / full |",
        "|---|---:|---:|---:|",
    ]
    for label, key, scale, unit in ROWS:
        lines.append(
            f"| {label} | {scale * full[key]:.1f} {unit} | {scale * adapter[key]:.1f} {unit} "
            f"| {ratio(adapter[key], full[key]):.3f} |"
        )
    return "\n".join(lines)


def machine(device: str) -> str:
    gpu = f", on {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (
        f"{os.cpu_count()} CPUs{gpu}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.platform()}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", choices=["tiny", "small"], default="tiny",
        help="Which proxrl test model (default: tiny).",
    )  # fmt: skip
    parser.add_argument(
        "--publishes", type=positive_int, default=5,
        help="Measured publishes of each kind, after one warm-up each (default: 5).",
    )  # fmt: skip
    parser.add_argument(
        "--streams", type=positive_int, default=4,
        help="Clients streaming while each publish goes out (default: 4).",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=positive_int, default=48,
        help="max_tokens of each streamed answer (default: 48).",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="Where the proxy's engine runs (default: cpu).",
    )  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the proxy stops too
    started = time.perf_counter()
    hf_logging.disable_progress_bar()
    print(f"machine: {machine(args.device)}")
    os.environ.update(PROXRL_ENGINE_DEVICE=args.device, PROXRL_ENGINE_DTYPE="float32")
    model_dir = ensure_model(args.size)
    full, adapter = measure(model_dir, args)
    table = markdown_table(full, adapter)
    answers = full["answers"] + adapter["answers"]
    print(
        f"\n{args.size} model, {args.publishes} publishes of each kind under {args.streams} "
        f"streams\n\n{table}\n\nall {answers} streamed answers complete; "
        f"total {time.perf_counter() - started:.0f}s"
    )
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.device),
        "args": vars(args),
        "full": full,
        "adapter": adapter,
        "ratios": {key: ratio(adapter[key], full[key]) for _, key, _, _ in ROWS},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
