"""Throughput of proxrl's embedded engine vs Hugging Face ``model.generate``, same model and device.

Three scenarios, each reported as engine tokens/s divided by generate's tokens/s, all measured in
one run (the machine is shared and noisy, so only ratios from the same run mean anything):

1. one request: a ~32-token prompt, 256 new tokens; one POST /generate vs one ``generate`` call;
2. N concurrent requests (default 32) with prompts of 16..64 tokens and 8..256 new tokens each,
   all sent at once to the engine, vs ``generate`` called once per request, one after another;
3. the same N requests vs one left-padded static batch of N through ``generate``, which decodes
   every row to the longest request; only each request's own tokens count as served.

Both sides sample at temperature 1.0 and produce exactly the requested number of tokens (the
engine with ``ignore_eos``, ``generate`` with ``min_new_tokens``), with the same number of torch
threads, on the same device (``--device``: the CPU by default, or CUDA) in the same dtype
(``--dtype``), never at the same time; on CUDA each timing ends with a ``synchronize``. Each
scenario is measured ``--repeats`` times and the median wall time is used. Tokens/s counts
generated tokens only (prompts are not counted).

What it does not measure: latency (time to first token, inter-token), streaming, HTTP overhead
on its own, or output quality (the model is random). Results go to stdout and to
bench/results/engine.json (engine-cuda.json on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench.common import positive_int  # noqa: E402
from server.common.processes import EngineProcess  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
LOG_DIR = ROOT / ".cache" / "bench"
SEED = 0
# A request on the tiny model takes seconds; an engine that answers nothing for this long has
# stalled (its scheduler died, say), and waiting longer would only hide that.
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and how many new tokens each one gets."""

    prompts: list[list[int]]
    max_new_tokens: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.max_new_tokens)


def make_workload(
    rng: random.Random,
    vocab_size: int,
    count: int,
    prompt_len: tuple[int, int],
    new: tuple[int, int],
) -> Workload:
    lengths = [rng.randint(*prompt_len) for _ in range(count)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, [rng.randint(*new) for _ in range(count)])


def ensure_model(size: str) -> Path:
    """proxrl's test model of ``size``, built once under .cache/ (it is deterministic)."""
    model_dir = ROOT / ".cache" / "models" / size
    if not (model_dir / "model.safetensors").exists():
        from server.common.tiny_model import create_tiny_model

        create_tiny_model(model_dir, size)
    return model_dir


def timed(label: str, run: Callable[[], None]) -> float:
    """Wall seconds of one call of ``run``, with a progress line."""
    print(f"  {label} ...", end="", flush=True)
    started = time.perf_counter()
    run()
    if torch.cuda.is_initialized():  # generate may return before its last kernels ran
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(f" {seconds:.2f}s", flush=True)
    return seconds


# --- the engine: a separate process, driven over HTTP ---------------------------------------


async def _engine_batch(url: str, work: Workload) -> None:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    limits = httpx.Limits(max_connections=len(work.prompts) + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        bodies = [
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
            }
            for ids, n in zip(work.prompts, work.max_new_tokens, strict=True)
        ]
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in bodies))
    for reply, wanted in zip(replies, work.max_new_tokens, strict=True):
        reply.raise_for_status()
        got = reply.json()["meta_info"]["completion_tokens"]
        if got != wanted:
            raise RuntimeError(f"engine generated {got} tokens, expected {wanted}")


def engine_generate(engine: EngineProcess, work: Workload) -> None:
    """Send every request of ``work`` at once; return when the last answer is in."""
    try:
        asyncio.run(_engine_batch(engine.url, work))
    except httpx.TimeoutException:
        log = engine.log_path.read_text().splitlines()[-20:] if engine.log_path else []
        raise RuntimeError(
            f"the engine answered nothing for {REQUEST_TIMEOUT_S:.0f}s; "
            f"the end of its log ({engine.log_path}):\n" + "\n".join(log)
        ) from None


# --- Hugging Face generate, in this process -------------------------------------------------

# Plain sampling at temperature 1, as the engine does by default (generate's own default is
# top_k=50); min_new_tokens masks every EOS id, so each call makes exactly max_new_tokens.
HF_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def hf_generate(model, prompt: list[int], max_new_tokens: int) -> None:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **HF_SAMPLING,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    if out.shape[1] - ids.shape[1] != max_new_tokens:
        raise RuntimeError(
            f"generate made {out.shape[1] - ids.shape[1]} tokens, not {max_new_tokens}"
        )


def hf_sequential(model, work: Workload) -> None:
    """What a naive server does: one ``generate`` call per request, in arrival order."""
    for prompt, n in zip(work.prompts, work.max_new_tokens, strict=True):
        hf_generate(model, prompt, n)


def hf_static_batch(model, work: Workload, pad_id: int) -> None:
    """One left-padded batch; every row runs to the longest request's length."""
    width = max(len(p) for p in work.prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in work.prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in work.prompts], device=model.device
    )
    longest = max(work.max_new_tokens)
    out = model.generate(
        ids,
        attention_mask=mask,
        **HF_SAMPLING,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=pad_id,
    )
    if out.shape[1] - width != longest:
        raise RuntimeError(f"batched generate made {out.shape[1] - width} tokens, not {longest}")


# --- the run: warm up both sides, then alternate them round by round ------------------------


SCENARIOS = {
    "single": ("1 request", "generate"),
    "vs_sequential": ("{n} concurrent vs sequential generate", "generate, one at a time"),
    "vs_static_batch": ("{n} concurrent vs static-batch generate", "generate, static batch"),
}


def measure(
    engine: EngineProcess, model, pad_id: int, single: Workload, mixed: Workload, repeats: int
):
    """Wall seconds of each side of each scenario, ``repeats`` rounds, one phase at a time."""
    phases = {
        "engine single": lambda: engine_generate(engine, single),
        "engine concurrent": lambda: engine_generate(engine, mixed),
        "hf single": lambda: hf_generate(model, single.prompts[0], single.max_new_tokens[0]),
        "hf sequential": lambda: hf_sequential(model, mixed),
        "hf static batch": lambda: hf_static_batch(model, mixed, pad_id),
    }
    seconds: dict[str, list[float]] = {name: [] for name in phases}
    for round_ in range(1, repeats + 1):
        print(f"round {round_}/{repeats}")
        for name, run in phases.items():
            seconds[name].append(timed(name, run))
    return seconds


def summarize(seconds: dict[str, list[float]], single: Workload, mixed: Workload) -> dict:
    """Tokens/s (from the median wall time) of each side, and their ratio, per scenario."""
    pairs = {
        "single": ("engine single", "hf single", single.tokens),
        "vs_sequential": ("engine concurrent", "hf sequential", mixed.tokens),
        "vs_static_batch": ("engine concurrent", "hf static batch", mixed.tokens),
    }
    rows = {}
    for key, (engine, hf, tokens) in pairs.items():
        engine_tps = tokens / statistics.median(seconds[engine])
        hf_tps = tokens / statistics.median(seconds[hf])
        rows[key] = {
            "tokens": tokens,
            "engine_tok_s": engine_tps,
            "hf_tok_s": hf_tps,
            "ratio": engine_tps / hf_tps,
        }
    return rows


def markdown_table(rows: dict, requests: int) -> str:
    lines = [
        "| scenario | tokens | engine tok/s | HF baseline | HF tok/s | ratio |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for key, row in rows.items():
        scenario, baseline = SCENARIOS[key]
        lines.append(
            f"| {scenario.format(n=requests)} | {row['tokens']} | {row['engine_tok_s']:.0f} "
            f"| {baseline} | {row['hf_tok_s']:.0f} | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def machine(device: str) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def save(report: dict, device: str) -> None:
    path = RESULTS_DIR / ("engine.json" if device == "cpu" else f"engine-{device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="tiny",
        help="Which proxrl test model to serve (default: tiny, ~1.7M parameters).",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=32,
        help="Concurrent requests in the mixed-length scenario (default: 32).",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="Rounds per scenario; the median wall time is reported (default: 3).",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="Where both the engine and generate run (default: cpu).",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Weights and activations of both sides (default: float32).",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    host = machine(args.device)
    print(
        f"machine: {host['cpu_count']} CPUs, torch {host['torch']} with {host['torch_threads']} "
        f"threads on both sides, Python {host['python']}, {host['platform']}; "
        f"both sides on {host['device']} in {args.dtype}"
    )
    torch.manual_seed(SEED)
    model_dir = ensure_model(args.size)
    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    pad_id, vocab = model.config.pad_token_id, model.config.vocab_size
    rng = random.Random(SEED)
    single = make_workload(rng, vocab, 1, (32, 32), (256, 256))
    mixed = make_workload(rng, vocab, args.requests, (16, 64), (8, 256))
    warmup = make_workload(rng, vocab, 4, (16, 64), (16, 16))
    print(f"model: {args.size}; {args.requests} requests, {mixed.tokens} new tokens in all")

    LOG_DIR.mkdir(parents=True, exist_ok=True)
    print("starting the engine ...", flush=True)
    threads = str(host["torch_threads"])
    log_path = LOG_DIR / "engine.log"
    flags = ("--num-threads", threads, "--device", args.device, "--dtype", args.dtype)
    with EngineProcess(model_dir, log_path, *flags) as engine:
        print("warm-up")
        timed("engine warm-up", lambda: engine_generate(engine, warmup))
        timed("hf warm-up", lambda: hf_sequential(model, warmup))
        timed("hf batch warm-up", lambda: hf_static_batch(model, warmup, pad_id))
        seconds = measure(engine, model, pad_id, single, mixed, args.repeats)

    rows = summarize(seconds, single, mixed)
    table = markdown_table(rows, args.requests)
    total = time.perf_counter() - started
    print(f"\n{table}\n")
    print(f"ratio = engine tok/s / HF tok/s, both measured in this run; total {total:.0f}s")
    save(
        {
            "machine": host,
            "args": vars(args),
            "table": table,
            "rows": rows,
            "seconds": seconds,
            "total_seconds": total,
        },
        args.device,
    )


if __name__ == "__main__":
    main()
