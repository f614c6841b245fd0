"""The embedded engine's prefix cache: time to first token of an agent's next step, cold vs warm.

A coding agent resends its whole history each step. For each prompt length (``--lengths``,
default 8192 tokens) the bench builds the tiny model with ``--context`` positions and, in one
process, on one in-process ``EngineService`` per case:

1. ``first``: a random prompt of that length, answered with ``--answer`` tokens (the step before);
2. ``next``: that prompt, its answer and ``--turn`` new tokens (the next step), asked for one
   token: its wall time is the time to first token (prefill + one sampled token; no HTTP).

``cold`` runs with the prefix cache off (``prefix_cache_mb=0``), ``warm`` with it on; the ratio
``cold / warm`` of ``next`` is what the cache buys. Both run here, one after the other, with the
same torch threads (``--threads``; 1 by default: on a loaded 2-core machine one thread was much
faster than two), so only ratios from one run mean anything. The counters of the warm service
(hits, reused tokens) are reported. Results go to stdout and to bench/results/prefix_cache.json.

What it does not measure: the proxy (tokenizing, rendering, recording), several sessions at
once, or eviction under pressure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from server.common.tiny_model import create_tiny_model  # noqa: E402
from server.engine import protocol  # noqa: E402
from server.engine.service import EngineService  # noqa: E402
from server.engine.settings import EngineSettings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "prefix_cache.json"


def generate(service: EngineService, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    request = protocol.GenerateRequestIn(
        input_ids=ids,
        sampling_params={"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
    )
    items, _ = service.parse(request)
    started = time.perf_counter()
    out = asyncio.run(service.generate(request, items))[0]
    return list(out["output_ids"]), time.perf_counter() - started


def step(model: Path, length: int, args: argparse.Namespace, cache_mb: int) -> dict:
    service = EngineService(
        EngineSettings(
            model=str(model),
            device="cpu",
            num_threads=args.threads,
            context_length=args.context,
            prefix_cache_mb=cache_mb,
        )
    )
    service.scheduler.start()
    try:
        generator = torch.Generator().manual_seed(length)
        prompt = torch.randint(3, 680, (length,), generator=generator).tolist()
        answer, first_s = generate(service, prompt, args.answer)
        turn = torch.randint(3, 680, (args.turn,), generator=generator).tolist()
        _, next_s = generate(service, prompt + answer + turn, 1)
        return {
            "first_s": round(first_s, 3),
            "next_ttft_s": round(next_s, 3),
            "prefix_cache": service.prefix_cache_info(),
        }
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--answer", type=int, default=32, help="tokens of the first answer")
    parser.add_argument("--turn", type=int, default=256, help="new tokens of the next step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-mb", type=int, default=1024)
    args = parser.parse_args()
    model = create_tiny_model(
        Path(tempfile.mkdtemp(prefix="proxrl-bench-model-")), context=args.context
    )
    rows = []
    for length in args.lengths:
        cold = step(model, length, args, cache_mb=0)
        warm = step(model, length, args, cache_mb=args.cache_mb)
        row = {
            "prompt_tokens": length,
            "next_prompt_tokens": length + args.answer + args.turn,
            "cold": cold,
            "warm": warm,
            "ttft_ratio_cold_over_warm": round(cold["next_ttft_s"] / warm["next_ttft_s"], 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "threads": args.threads,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
