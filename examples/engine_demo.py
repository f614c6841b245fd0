"""What `make demo` runs until the learning demo lands: the embedded engine serving, hot-swapping.

It creates the tiny model (cached under .cache/), starts `proxrl engine` on loopback, runs
32 concurrent requests through SGLang's /generate, and swaps new weights in while requests are
running (pause in retract mode, load from disk, continue), showing which tokens came from which
weight version. Everything runs on this machine; nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from server.common.processes import EngineProcess

ROOT = Path(__file__).resolve().parent.parent

MODEL_DIR = ROOT / ".cache" / "models" / "tiny"
PROMPT = "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"


def ensure_model() -> Path:
    if not (MODEL_DIR / "model.safetensors").exists():
        from server.common.tiny_model import create_tiny_model

        print(f"creating the tiny model in {MODEL_DIR} ...")
        create_tiny_model(MODEL_DIR, "tiny")
    return MODEL_DIR


async def concurrent_requests(client: httpx.AsyncClient, url: str, count: int) -> None:
    started = time.perf_counter()
    bodies = [
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 16 + 8 * (i % 8)}}
        for i in range(count)
    ]
    replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in bodies))
    elapsed = time.perf_counter() - started
    tokens = sum(r.json()["meta_info"]["completion_tokens"] for r in replies)
    print(
        f"{count} concurrent requests: {tokens} tokens in {elapsed:.2f}s "
        f"= {tokens / elapsed:.0f} tokens/s (continuous batching)"
    )
    print(f"a sample (an untrained model, so: noise): {replies[0].json()['text'][:60]!r}")


async def hot_swap(client: httpx.AsyncClient, url: str) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
        "return_logprob": True,
    }
    running = asyncio.create_task(client.post(f"{url}/generate", json=body))
    await asyncio.sleep(0.3)
    await client.post(f"{url}/pause_generation", json={"mode": "retract"})
    swap = await client.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(MODEL_DIR), "weight_version": "step-1"},
    )
    await client.post(f"{url}/continue_generation", json={})
    meta = (await running).json()["meta_info"]
    print(f"weight swap mid-request: {swap.json()['message']}")
    for span in meta["weight_versions"]:
        print(f"  tokens {span['start']:>3}..{span['end']:<3} came from version {span['version']}")


async def main() -> None:
    model = ensure_model()
    print("starting the embedded engine (SGLang's HTTP protocol, on this CPU) ...")
    with EngineProcess(model, ROOT / ".cache" / "engine-demo.log") as engine:
        print(f"engine ready at {engine.url}")
        async with httpx.AsyncClient(timeout=120) as client:
            await concurrent_requests(client, engine.url, 32)
            await hot_swap(client, engine.url)
    print("done. The learning demo (proxy + trainer, reward going up) arrives with `proxrl demo`.")


if __name__ == "__main__":
    asyncio.run(main())
