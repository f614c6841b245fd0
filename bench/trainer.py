"""What the trainer's two mechanisms buy: padding-free packing, and weight swaps under traffic.

Two measurements on proxrl's test model, each a ratio of two numbers measured in this one run
(the machine is shared and noisy, so only ratios from the same run mean anything):

1. Training-step throughput, packed vs padded. One step's rows (``--rows``, lengths uniform in
   16..512, seeded) go through a forward and backward of a token-level loss (the mean negative
   log-likelihood of every token that has a predecessor in its row, each micro-batch's loss its
   share of the step's mean, as the worker shares it), micro-batch by micro-batch, gradients
   accumulated. Both sides have the same token budget (``--budget``, by default the
   trainer's ``max_tokens_per_microbatch``):

   - packed: ``pack(lengths, budget)`` then ``packed``, forwarded as the worker does
     (``[1, T]`` ids, positions restarting per row, no KV cache, and the packed-row attention
     of ``trainer/attention.py``: causal SDPA on each row's slice, no ``[T, T]`` mask);
   - padded, the standard "pad to longest" baseline: rows in step order, ``budget // longest
     row of the step`` rows per micro-batch (the most that always fit the budget padded), each
     micro-batch right-padded with ``padded`` to its own longest row (dynamic padding, as
     Hugging Face's collators do), forwarded with its ``[B, L]`` attention mask.

   First the whole step runs once on each side, untimed (a warm-up): the run stops unless both
   give the same loss and gradient norm (1e-4 relative), so both sides compute the same thing.
   Then each timed round takes the two sides' micro-batches in turns (packed 1, padded 1,
   packed 2, ...; padded first every other round), so a burst of load from other processes
   falls on both sides rather than on one whole pass. A side's step time is the sum over its
   micro-batches of each one's median over rounds; tokens/s counts real (non-pad) tokens. The
   optimizer step costs the same on both sides and is left out. ``torch`` runs 2 threads; the
   models run on ``--device`` (the CPU by default, or CUDA, where each timing ends with a
   ``synchronize``), in float32.

2. Engine pause per weight swap vs loading the same weights alone. ``proxrl serve`` (its own
   embedded engine) on the model; every round, ``--clients`` clients stream chat completions
   through the ``openai`` SDK, each in its own session, one request after another; once all of
   them are mid-answer, POST /admin/weights publishes a new version (the model's weights,
   perturbed, written as a Hugging Face directory with the trainer's ``write_model_dir``), and
   the answer's ``pause_seconds`` is kept: engines paused (in-flight requests aborted and
   resubmitted by the proxy), weights read and loaded, engines resumed. Then the clients
   finish their answers and stop, and, with nothing else running, this process times
   ``read_checkpoint`` of the same directory plus copying it into an in-process
   ``AutoModelForCausalLM`` (what the engine does to load it), both on ``--device`` in float32
   (the proxy's engine is told so through ``PROXRL_ENGINE_DEVICE`` and ``PROXRL_ENGINE_DTYPE``).
   The ratio pause / load is what a swap costs beyond reading and copying the weights. Every
   answer must be complete: a finish reason, usage, ``max_tokens`` tokens when cut at the
   length, and the store holding exactly the tokens the client was told of. The directories
   were just written, so both sides read them from the page cache; a cold disk would add the
   same read time to both.

What it does not measure: the optimizer, FSDP or Ray overhead, several workers or GPUs,
broadcast (NCCL/gloo) weight updates, several engines, or latency as the clients see it.
Results go to stdout and to bench/results/trainer-<date>.md (trainer-<date>-cuda.md on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import platform
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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
from server.common.processes import ProxyProcess  # noqa: E402
from server.common.weight_transfer import read_checkpoint  # noqa: E402
from trainer import attention  # noqa: E402
from trainer.batching import packed, padded, shift_logprobs  # noqa: E402
from trainer.config import AlgorithmConfig  # noqa: E402
from trainer.model import output_embedding_name  # noqa: E402
from trainer.plan import pack  # noqa: E402
from trainer.worker import write_model_dir  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
SEED = 0
THREADS = 2
# server.startup gives its one embedded engine all CPUs but one; two OpenMP threads losing a core
# to another process stall (a 7 MB load took 13 to 195 ms with 2 threads, 7 to 22 ms with 1).
ENGINE_THREADS = max(1, (os.cpu_count() or 1) - 1)
ROW_LENGTHS = (16, 512)
LOSS_RTOL = 1e-4
# Timed rounds stop after this long once MIN_ROUNDS are done: the run stays bounded when the
# machine is busy (a quiet round of the default step takes ~10 s on 2 cores).
MIN_ROUNDS = 2
PACKING_DEADLINE_S = 60.0
# Each version moves every weight by this much noise: a new version, the same shapes.
PERTURBATION = 1e-3
# A request on the tiny model takes a second or two; one that takes this long has stalled.
REQUEST_TIMEOUT_S = 120.0
IN_FLIGHT_TIMEOUT_S = 60.0
T = TypeVar("T")  # what one streaming client records of an answer


# --- 1. packed vs padded training step ------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One way to run the step: its micro-batches (row indices) and each one's loss share."""

    name: str
    model: torch.nn.Module  # the same weights on both sides; each its own attention
    plan: list[list[int]]
    micro_loss: Callable[[list[int]], torch.Tensor]


def make_rows(rng: random.Random, vocab_size: int, count: int) -> list[list[int]]:
    lengths = [rng.randint(*ROW_LENGTHS) for _ in range(count)]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def padded_plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows in step order, as many per micro-batch as always fit ``budget`` when padded."""
    per = max(1, budget // max(lengths))
    return [list(range(s, min(s + per, len(lengths)))) for s in range(0, len(lengths), per)]


def packed_loss(model, rows: list[list[int]], loss_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's mean NLL, rows packed into one ``[1, T]`` row."""
    batch = packed(rows)
    ids, cu_seqlens = batch.input_ids.to(model.device), batch.cu_seqlens.to(model.device)
    logits = model(
        input_ids=ids,
        position_ids=batch.position_ids.to(model.device),
        cu_seq_lens_q=cu_seqlens,
        use_cache=False,
    ).logits
    logprobs = shift_logprobs(logits[0].float(), ids[0], cu_seqlens)
    return -logprobs.sum() / loss_tokens  # 0 at row starts: they predict nothing


def padded_loss(model, rows: list[list[int]], pad_id: int, loss_tokens: int) -> torch.Tensor:
    """The same share, rows right-padded to the micro-batch's longest; pads masked out."""
    batch = padded(rows, pad_id)
    ids, mask = batch.input_ids.to(model.device), batch.attention_mask.to(model.device)
    size, width = ids.shape
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    row_starts = torch.arange(0, size * width + 1, width, dtype=torch.int32, device=model.device)
    flat_ids = ids.reshape(-1)
    logprobs = shift_logprobs(logits.reshape(size * width, -1).float(), flat_ids, row_starts)
    return -(logprobs * mask.reshape(-1)).sum() / loss_tokens


def micro_step(side: Side, micro: list[int]) -> tuple[float, float]:
    """Seconds of one micro-batch's forward and backward, and its loss share."""
    started = time.perf_counter()
    share = side.micro_loss(micro)
    share.backward()
    synchronize()
    return time.perf_counter() - started, float(share.detach())


def synchronize() -> None:
    """Wait for queued CUDA kernels (if this process uses CUDA), so a timing covers them."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def whole_step(side: Side) -> tuple[float, float]:
    """The step's loss and gradient norm on one side (gradients accumulated from zero)."""
    side.model.zero_grad(set_to_none=True)
    loss = sum(micro_step(side, micro)[1] for micro in side.plan)
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in side.model.parameters()))
    return loss, float(norm)


def interleaved_round(sides: list[Side]) -> dict[str, list[float]]:
    """Seconds of every micro-batch of both sides, taken in turns, so that a burst of load
    from other processes falls on both sides alike rather than on one whole pass."""
    for side in sides:
        side.model.zero_grad(set_to_none=True)
    seconds: dict[str, list[float]] = {side.name: [] for side in sides}
    for micros in itertools.zip_longest(*(side.plan for side in sides)):
        for side, micro in zip(sides, micros, strict=True):
            if micro is not None:
                seconds[side.name].append(micro_step(side, micro)[0])
    return seconds


def measure_packing(
    packed_model, padded_model, rows: list[list[int]], budget: int, repeats: int
) -> dict:
    """Packed vs padded over the same rows: same loss and gradient first, then timed rounds."""
    lengths = [len(r) for r in rows]
    loss_tokens = sum(n - 1 for n in lengths)
    pad_id = padded_model.config.pad_token_id
    packed_side = Side(
        "packed",
        packed_model,
        pack(lengths, budget),
        lambda m: packed_loss(packed_model, [rows[i] for i in m], loss_tokens),
    )
    padded_side = Side(
        "padded",
        padded_model,
        padded_plan(lengths, budget),
        lambda m: padded_loss(padded_model, [rows[i] for i in m], pad_id, loss_tokens),
    )
    print("warm-up and check: the whole step on each side, untimed", flush=True)
    check = {side.name: whole_step(side) for side in (packed_side, padded_side)}
    for index, what in enumerate(("loss", "gradient norm")):
        x, y = check["packed"][index], check["padded"][index]
        if rel_diff(x, y) > LOSS_RTOL:
            raise RuntimeError(f"packed {what} {x:.8f} != padded {y:.8f}: not the same step")
    rounds: list[dict[str, list[float]]] = []
    started = time.perf_counter()
    while len(rounds) < repeats and (
        len(rounds) < MIN_ROUNDS or time.perf_counter() - started < PACKING_DEADLINE_S
    ):
        order = [packed_side, padded_side] if len(rounds) % 2 == 0 else [padded_side, packed_side]
        rounds.append(interleaved_round(order))
        print(
            f"  round {len(rounds)}/{repeats}: "
            + ", ".join(f"{name} {sum(s):.2f}s" for name, s in sorted(rounds[-1].items())),
            flush=True,
        )
    # a micro-batch's median over rounds, summed: a burst hitting one micro-batch moves nothing
    step_s = {
        name: sum(statistics.median(r[name][j] for r in rounds) for j in range(len(plan)))
        for name, plan in (("packed", packed_side.plan), ("padded", padded_side.plan))
    }
    computed = sum(len(m) * max(lengths[i] for i in m) for m in padded_side.plan)
    return {
        "rows": len(rows),
        "tokens": sum(lengths),
        "budget": budget,
        "rounds": len(rounds),
        "packed_micro_batches": len(packed_side.plan),
        "padded_micro_batches": len(padded_side.plan),
        "rows_per_padded_micro_batch": len(padded_side.plan[0]),
        "padding_fraction": 1 - sum(lengths) / computed,
        "packed_tok_s": sum(lengths) / step_s["packed"],
        "padded_tok_s": sum(lengths) / step_s["padded"],
        "ratio": step_s["padded"] / step_s["packed"],
        # per layer and head: packed rows attend within themselves [n, n], padded rows [L, L]
        "packed_attention_scores": sum(n * n for n in lengths),
        "padded_attention_scores": sum(
            len(m) * max(lengths[i] for i in m) ** 2 for m in padded_side.plan
        ),
        "round_ratios": [sum(r["padded"]) / sum(r["packed"]) for r in rounds],
        "loss": check["packed"][0],
        "loss_rel_diff": rel_diff(check["packed"][0], check["padded"][0]),
        "grad_norm_rel_diff": rel_diff(check["packed"][1], check["padded"][1]),
        "micro_batch_seconds": rounds,
    }


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


# --- 2. engine pause per swap vs loading the weights alone ----------------------------------


@dataclass
class Answer:
    """One streamed chat completion as its client saw it."""

    started: float
    ended: float
    finish_reason: str | None
    completion_tokens: int | None


@dataclass
class SwapRound:
    """One publish under streaming clients, and the same weights loaded alone afterwards."""

    pause_seconds: float  # as POST /admin/weights answered it
    version: int
    published: tuple[float, float]  # when the POST went out and its answer came back
    answers: list[list[Answer]]  # per client
    load_seconds: float = 0.0  # read_checkpoint + copy in this process, timed after the round


def write_versions(model, base: Path, out: Path, count: int) -> list[Path]:
    """``count`` new versions of ``model``'s weights, each a Hugging Face directory."""
    tied_name = output_embedding_name(model)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    generator = torch.Generator().manual_seed(SEED)
    dirs = []
    for version in range(count):
        noisy = {
            n: t + PERTURBATION * torch.randn(t.shape, generator=generator)
            for n, t in state.items()
        }
        dirs.append(out / f"version-{version}")
        write_model_dir(noisy, base, dirs[-1], tied_name)
    return dirs


@torch.inference_mode()
def load_from_disk(model, path: Path) -> float:
    """Seconds to read ``path``'s safetensors and copy them into ``model`` by name, with as many
    torch threads as the proxy gives its embedded engine (on 2 CPUs, 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(ENGINE_THREADS)
    started = time.perf_counter()
    state = model.state_dict()
    for name, tensor in read_checkpoint(path).items():
        if state[name].shape != tensor.shape:
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} in {path}")
        state[name].copy_(tensor)
    synchronize()
    seconds = time.perf_counter() - started
    torch.set_num_threads(threads)
    return seconds


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
        started, reason, usage = time.perf_counter(), None, None
        chunks = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count with me: {seed}, {seed + 1},"}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                mid.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        mid.clear()
        answers.append(Answer(started, time.perf_counter(), reason, usage))
        seed += 1
    return answers


async def publish_while_streaming(
    proxy: ProxyProcess,
    stream: Callable[[int, asyncio.Event, asyncio.Event], Awaitable[list[T]]],
    count: int,
    body: dict,
) -> tuple[dict, tuple[float, float], list[list[T]]]:
    """``count`` clients streaming (``stream(index, mid, stop)``: one client's answers until
    ``stop``, ``mid`` set while it is mid-answer); ``body`` POSTed to /admin/weights once all are
    mid-answer; then the clients let finish. The publish's answer, when it was sent and
    answered, and each client's answers."""
    stop = asyncio.Event()
    mids = [asyncio.Event() for _ in range(count)]
    clients = [asyncio.create_task(stream(index, mid, stop)) for index, mid in enumerate(mids)]
    try:
        deadline = time.monotonic() + IN_FLIGHT_TIMEOUT_S
        while not all(m.is_set() for m in mids):
            if time.monotonic() > deadline or any(c.done() for c in clients):
                raise RuntimeError("the clients never were all mid-answer at once")
            await asyncio.sleep(0.005)
        async with httpx.AsyncClient(headers=proxy.admin, timeout=REQUEST_TIMEOUT_S) as http:
            sent = time.perf_counter()
            reply = await http.post(f"{proxy.url}/admin/weights", json=body)
            answered = time.perf_counter()
        reply.raise_for_status()
    finally:
        stop.set()
    answers = await asyncio.gather(*clients)
    return reply.json(), (sent, answered), list(answers)


async def swap_round(
    proxy: ProxyProcess, sdks: list[AsyncOpenAI], model: str, path: Path, seed: int, max_tokens: int
) -> SwapRound:
    """Clients streaming; publish ``path`` once all are mid-answer; let them finish."""

    def stream(index: int, mid: asyncio.Event, stop: asyncio.Event) -> Awaitable[list[Answer]]:
        return stream_until(sdks[index], model, seed + 1000 * index, max_tokens, mid, stop)

    body = {"model_path": str(path)}
    answer, published, answers = await publish_while_streaming(proxy, stream, len(sdks), body)
    return SwapRound(answer["pause_seconds"], answer["policy_version"], published, answers)


def stored_turns(proxy: ProxyProcess, session_id: str) -> list[dict]:
    """The turns the proxy stored for a session (admin key)."""
    reply = httpx.get(f"{proxy.url}/rl/sessions/{session_id}", headers=proxy.admin, timeout=60)
    reply.raise_for_status()
    return reply.json()["turns"]


def check_answers(
    proxy: ProxyProcess, sessions: list[dict], rounds: list[SwapRound], max_tokens: int
) -> dict:
    """Every answer complete, and stored exactly as the client was told; counts of the swaps'
    victims: answers in flight across a publish, and those the proxy resubmitted."""
    total = in_flight = resubmitted = on_new_version = 0
    for index, session in enumerate(sessions):
        stored = stored_turns(proxy, session["session_id"])
        told = sum(len(round_.answers[index]) for round_ in rounds)
        if len(stored) != told:
            raise RuntimeError(f"{len(stored)} turns stored for {told} answers of client {index}")
        turns = iter(stored)
        for round_ in rounds:
            sent, answered = round_.published
            for answer in round_.answers[index]:
                turn = next(turns)
                total += 1
                complete = answer.finish_reason in ("stop", "length") and (
                    answer.completion_tokens is not None
                    and answer.completion_tokens == len(turn["completion_ids"])
                    and (answer.finish_reason == "stop" or answer.completion_tokens == max_tokens)
                )
                if not complete:
                    raise RuntimeError(
                        f"incomplete answer: {answer} vs stored {len(turn['completion_ids'])}"
                    )
                in_flight += answer.started < sent and answer.ended > answered
                if turn["resubmits"]:
                    resubmitted += 1
                    on_new_version += turn["versions"][-1] == round_.version
    return {
        "answers": total,
        "in_flight": in_flight,
        "resubmitted": resubmitted,
        "on_new_version": on_new_version,
    }


def measure_swaps(model_dir: Path, args: argparse.Namespace) -> dict:
    """Warm-up round, then ``--swaps`` rounds: a publish under streaming, a load alone."""
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # The proxy's engine loads each version where and as the load alone does.
    os.environ.update(PROXRL_ENGINE_DEVICE=args.device, PROXRL_ENGINE_DTYPE="float32")
    with tempfile.TemporaryDirectory(prefix="proxrl-bench-") as tmp:
        versions = write_versions(model, model_dir, Path(tmp), args.swaps + 1)
        model.to(args.device)
        print("starting the proxy (with its engine) ...", flush=True)
        with ProxyProcess(model_dir, Path(tmp) / "data", secrets.token_hex(16)) as proxy:
            sessions = asyncio.run(new_sessions(proxy.url, proxy.admin, args.clients))
            rounds = []
            for index, path in enumerate(versions):
                label = "warm-up" if index == 0 else f"round {index}/{args.swaps}"
                print(f"  {label}: publish under {args.clients} streams ...", end="", flush=True)
                round_ = asyncio.run(run_round(proxy, sessions, model_dir.name, path, index, args))
                round_.load_seconds = load_from_disk(model, path)
                print(
                    f" pause {round_.pause_seconds:.3f}s; load alone {round_.load_seconds:.3f}s",
                    flush=True,
                )
                rounds.append(round_)
            checked = check_answers(proxy, sessions, rounds, args.max_tokens)
        size = sum(p.stat().st_size for p in versions[0].glob("*.safetensors"))
    pause = statistics.median(r.pause_seconds for r in rounds[1:])
    load = statistics.median(r.load_seconds for r in rounds[1:])
    return {
        "swaps": args.swaps,
        "clients": args.clients,
        "pause_s": pause,
        "load_s": load,
        "ratio": pause / load,
        "pause_seconds": [r.pause_seconds for r in rounds[1:]],
        "load_seconds": [r.load_seconds for r in rounds[1:]],
        "megabytes": size / 1e6,
        **checked,
    }


async def run_round(
    proxy: ProxyProcess, sessions: list[dict], model: str, path: Path, index: int, args
) -> SwapRound:
    sdks = [
        AsyncOpenAI(
            base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        for s in sessions
    ]
    try:
        return await swap_round(proxy, sdks, model, path, SEED + 100_000 * index, args.max_tokens)
    finally:
        for sdk in sdks:
            await sdk.close()


# --- the run --------------------------------------------------------------------------------


def ensure_model(size: str) -> Path:
    """proxrl's test model of ``size``, built once under .cache/ (it is deterministic)."""
    model_dir = ROOT / ".cache" / "models" / size
    if not (model_dir / "model.safetensors").exists():
        from server.common.tiny_model import create_tiny_model

        create_tiny_model(model_dir, size)
    return model_dir


def markdown_table(step: dict, swap: dict, size: str) -> str:
    lines = [
        "| measurement | proxrl | value | baseline | value | ratio |",
        "|---|---|---:|---|---:|---:|",
        f"| training step, {step['rows']} rows ({step['tokens']} tokens), {size} model, fwd+bwd "
        f"| packed: {step['packed_micro_batches']} micro-batches of <= {step['budget']} tokens "
        f"| {step['packed_tok_s']:.0f} tok/s "
        f"| padded to longest: {step['padded_micro_batches']} micro-batches of "
        f"{step['rows_per_padded_micro_batch']} rows, "
        f"{100 * step['padding_fraction']:.0f}% padding "
        f"| {step['padded_tok_s']:.0f} tok/s | {step['ratio']:.2f}x |",
        f"| weight swap, {swap['swaps']} publishes under {swap['clients']} streams "
        f"({swap['megabytes']:.1f} MB) | engine pause (`pause_seconds`), median "
        f"| {1000 * swap['pause_s']:.1f} ms | `read_checkpoint` + copy, alone, median "
        f"| {1000 * swap['load_s']:.1f} ms | {swap['ratio']:.2f}x |",
    ]
    return "\n".join(lines)


def notes(step: dict, swap: dict) -> list[str]:
    rounds = ", ".join(f"{r:.2f}" for r in step["round_ratios"])
    pauses = ", ".join(f"{1000 * s:.1f}" for s in swap["pause_seconds"])
    loads = ", ".join(f"{1000 * s:.1f}" for s in swap["load_seconds"])
    return [
        "training step: tok/s = real (non-pad) tokens / step time, the sum of each "
        f"micro-batch's median over {step['rounds']} interleaved rounds; ratio = packed / "
        f"padded; per-round ratios {rounds}",
        f"same step on both sides: loss {step['loss']:.6f}, relative difference "
        f"{step['loss_rel_diff']:.1e} (gradient norm {step['grad_norm_rel_diff']:.1e})",
        "attention scores computed per layer and head: packed "
        f"{step['packed_attention_scores'] / 1e6:.1f}M (each row over itself), padded "
        f"{step['padded_attention_scores'] / 1e6:.1f}M (each row over the longest row's length)",
        f"weight swap: ratio = pause / load alone; pauses ms {pauses}; loads ms {loads}",
        f"streamed answers complete: {swap['answers']}/{swap['answers']}; in flight across a "
        f"publish: {swap['in_flight']}; resubmitted by the proxy: {swap['resubmitted']}, of which "
        f"{swap['on_new_version']} ended on the new version",
    ]


def save(text: str, today: str, device: str) -> Path:
    suffix = "" if device == "cpu" else f"-{device}"
    path = RESULTS_DIR / f"trainer-{today}{suffix}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="tiny",
        help="Which proxrl test model (default: tiny; a small pass takes ~1 min on 2 cores).",
    )
    parser.add_argument(
        "--rows", type=positive_int, default=32, help="Rows in the training step (default: 32)."
    )
    parser.add_argument("--seed", type=int, default=SEED, help="Seed of the rows (default: 0).")
    parser.add_argument(
        "--budget",
        type=positive_int,
        default=AlgorithmConfig().max_tokens_per_microbatch,
        help="Token budget of a training micro-batch, both sides (default: the trainer's "
        "max_tokens_per_microbatch).",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="Timed rounds of the training step at most; they stop after "
        f"{PACKING_DEADLINE_S:.0f}s once {MIN_ROUNDS} are done (default: 5).",
    )
    parser.add_argument(
        "--swaps", type=positive_int, default=5, help="Measured publishes (default: 5)."
    )
    parser.add_argument(
        "--clients", type=positive_int, default=4, help="Streaming clients (default: 4)."
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=48,
        help="max_tokens of each streamed answer (default: 48).",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="Where the training step, the proxy's engine and the load alone run (default: cpu).",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.budget < ROW_LENGTHS[1]:
        parser.error(f"--budget must hold the longest row ({ROW_LENGTHS[1]} tokens)")
    return args


def machine(device: str) -> str:
    gpu = f", on {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (
        f"{os.cpu_count()} CPUs{gpu}, torch {torch.__version__} with {THREADS} threads, "
        f"Python {platform.python_version()}, {platform.platform()}"
    )


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the proxy stops too
    started = time.perf_counter()
    torch.set_num_threads(THREADS)
    torch.manual_seed(args.seed)
    print(f"machine: {machine(args.device)}")
    model_dir = ensure_model(args.size)
    hf_logging.disable_progress_bar()
    attention.register()
    packed_model, padded_model = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=implementation
        )
        .to(args.device)
        .train()
        for implementation in (attention.NAME, "sdpa")
    )
    rows = make_rows(random.Random(args.seed), padded_model.config.vocab_size, args.rows)
    tokens = sum(map(len, rows))
    print(f"1. training step: {args.size} model, {args.rows} rows, {tokens} tokens")
    step = measure_packing(packed_model, padded_model, rows, args.budget, args.repeats)
    print(f"2. weight swaps: {args.swaps} (+1 warm-up) under {args.clients} streaming clients")
    swap = measure_swaps(model_dir, args)

    table = markdown_table(step, swap, args.size)
    lines = [*notes(step, swap), f"total {time.perf_counter() - started:.0f}s"]
    print(f"\n{table}\n\n" + "\n".join(lines))
    today = datetime.date.today().isoformat()
    header = [f"# bench/trainer.py, {today}", "", f"machine: {machine(args.device)}", ""]
    header += [f"args: `{vars(args)}`", "", table, ""]
    path = save("\n".join(header + [f"- {line}" for line in lines]) + "\n", today, args.device)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
