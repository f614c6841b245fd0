"""What asynchronous RL buys here: one task trained three ways, on one machine, in one run.

The task is the length-varying arithmetic format of ``examples/agents/arithmetic.py`` (a chain
of 1 to 8 running sums, so completion lengths are long-tailed: a few tokens to about 50), on
proxrl's tiny model after a short supervised warm-up (``trainer.warmup.cached_warm_start``,
cached under ``.proxrl-cache``: the first run pays for it once). Each mode gets a fresh
``proxrl serve`` (``trainer.run.LocalServer``: its own embedded engine and SQLite data dir) and
a ``proxrl train`` subprocess attached to it, and trains to the same number of samples
(``--steps`` steps of ``--batch-size`` sessions, GRPO groups of ``--group-size``):

1. ``sync``: ``max_staleness=0``. The server admits at most ``(version + 1) * batch_size``
   sessions, so a batch is generated only once the previous step is published: generation
   waits for training and training waits for generation. Plain PPO (``algorithm.decoupled=
   false``): with one PPO minibatch every token is on-policy, so the decoupled loss would
   compute the same update and only add a forward pass for the proximal logprobs.
2. ``async``: ``max_staleness=4``, decoupled PPO (the proxy's default algorithm).
3. ``async-plain``: ``max_staleness=4``, plain PPO (the ablation: stale tokens, no proximal
   policy and no behaviour weight).

The agent runs in this process: ``--concurrency`` sessions in flight (asyncio; ``AsyncClient``
with many retries, so admission waits and 429s only wait), each a GRPO group member asking one
problem through ``session.async_openai()`` at temperature 1, rewarded 1 for the exact final
answer, then ended. A group's sessions are created together and groups are created one after
another, so admission never lets in part of a group (a half-admitted group could never be
claimed, and a synchronous run would stop). The agent starts once the trainer has configured
the run (its workers are up), and stops when the trainer has logged its last step.

Per mode: wall time from the agent's start to the trainer's last step; trained tokens (the sum
of ``trained_tokens`` in the trainer's ``metrics.jsonl``) over that wall time, i.e. effective
training throughput, and its ratio to ``sync``; the mean ``reward_mean`` of the last
``--final-steps`` steps; the time spent training (sum of ``train_seconds`` +
``publish_seconds``) and generating (time with at least one session in flight).

The ideal overlap bound: before each trainer starts, the agent generates ``--batch-size``
sessions twice on a separate run of the same server (no admission, nothing training; the
first round warms the engine up): the median second round is the generation time of one
step when nothing competes with it. The training time of a step is the ``sync`` run's mean
train + publish seconds (training alone: generation waits). Overlapping the two perfectly
gives at best ``(gen + train) / max(gen, train)`` times the synchronous throughput, before
counting that on a CPU-only machine both halves need the same cores.

Target: ``async`` >= 1.5x the ``sync`` throughput with a final reward within 0.05 of ``sync``.
What it does not measure: GPUs, several engines or workers, SGLang, multi-turn agents, or
accuracy after equal wall time (every mode trains the same samples). Results go to stdout and to
bench/results/async-vs-sync-<date>.md; logs, metrics and checkpoints to
.cache/bench/async-vs-sync/<mode>/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "agents"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import arithmetic  # noqa: E402  (examples/agents, on the path above)
import httpx  # noqa: E402
from math_agent import AgentLog, MathAgent  # noqa: E402

from bench.common import positive_int  # noqa: E402
from client_sdk import AsyncClient  # noqa: E402
from trainer.run import LocalServer, TrainerProcess  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
LOG_DIR = ROOT / ".cache" / "bench" / "async-vs-sync"
CACHE_DIR = ROOT / ".proxrl-cache"
TEMPERATURE = 1.0
# Numbers 1..9: sums stay small enough that a short warm-up leaves the tiny model partly right.
MAX_OPERAND = 9
WARMUP_EXAMPLES = 4000
WARMUP = {"size": "tiny", "steps": 200, "lr": 3e-3, "batch_size": 32}
# Session creation waits in the server for admission up to this long (the run's
# admission_wait_s); requests time out well after it. 429s and 5xx are retried this often.
ADMISSION_WAIT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
MAX_RETRIES = 1000
TRAINER_START_TIMEOUT_S = 300.0
TARGET_SPEEDUP = 1.5
TARGET_REWARD_GAP = 0.05

log = logging.getLogger("bench.async_vs_sync")


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    max_staleness: int
    decoupled: bool


def modes(staleness: int) -> list[Mode]:
    return [
        Mode("sync", "synchronous (staleness 0), plain PPO", 0, False),
        Mode("async", f"asynchronous (staleness {staleness}), decoupled PPO", staleness, True),
        Mode("async-plain", f"asynchronous (staleness {staleness}), plain PPO", staleness, False),
    ]


# --- one mode --------------------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: Mode
    wall_s: float
    steps: list[dict]
    agent: AgentLog
    calibration_s: float  # one batch generated alone (second round)
    calibration_reward: float
    calibration_tokens: int

    @property
    def trained_tokens(self) -> int:
        return sum(s["trained_tokens"] for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s

    @property
    def train_s(self) -> float:
        return sum(s["train_seconds"] + s["publish_seconds"] for s in self.steps)

    def final_reward(self, last: int) -> float:
        return statistics.mean(s["reward_mean"] for s in self.steps[-last:])

    @property
    def staleness(self) -> float:
        return statistics.mean(s["staleness_mean"] for s in self.steps)


def start_trainer(server: LocalServer, mode: Mode, out: Path, args) -> TrainerProcess:
    overrides = [
        f"max_steps={args.steps}",
        f"batch_size={args.batch_size}", f"max_staleness={mode.max_staleness}",
        f"lr={args.lr}", f"seed={args.seed}", f"checkpoint_every={args.steps}",
        "claim_wait_s=0.05", "algorithm.advantage=grpo",
        f"algorithm.group_size={args.group_size}",
        f"algorithm.decoupled={'true' if mode.decoupled else 'false'}",
        f"algorithm.temperature={TEMPERATURE}",
        f"algorithm.ppo_minibatches={args.ppo_minibatches}",
        # AReaL's ablation bounds every trained token's staleness by eta: tokens past it masked
        # (the trainer's default keeps them, judging staleness at admission; both are the
        # same on these single-turn sessions but for a publish between a sample and its reward)
        "algorithm.stale=mask",
    ]  # fmt: skip
    return TrainerProcess(server, out / "trainer", overrides, out / "trainer.log")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def wait_configured(
    client: AsyncClient, run_id: str, batch_size: int, trainer: TrainerProcess
) -> None:
    """Until the trainer has written its batch size into the run (its workers are up)."""
    deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
    while (await client.get_run(run_id))["config"].get("batch_size") != batch_size:
        if (code := trainer.exited()) is not None:
            raise RuntimeError(f"proxrl train exited with {code} before starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"proxrl train did not start in {TRAINER_START_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.2)


async def until_trained(trainer: TrainerProcess, steps: int, timeout_s: float) -> None:
    """Until the trainer logged its last step (or exited, or ran out of time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = trainer.steps()
        if done and done[-1]["step"] >= steps:
            return
        if (code := trainer.exited()) is not None:
            raise RuntimeError(
                f"proxrl train exited with {code} after {len(done)} of {steps} steps"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(done)} of {steps} steps in {timeout_s:.0f}s: stopped")
        await asyncio.sleep(0.25)


@dataclass(frozen=True)
class Trained:
    steps: list[dict]  # the trainer's metrics.jsonl lines, one per step
    agent: AgentLog
    started: float  # time.time() when the agent started (the trainer's workers up)
    trainer: TrainerProcess  # still running until the caller's stack stops it

    @property
    def wall_s(self) -> float:
        """From the agent's start to the trainer's last step."""
        return self.steps[-1]["time"] - self.started


async def train_alongside(
    client: AsyncClient,
    http: httpx.AsyncClient,
    server: LocalServer,
    run: dict,
    mode: Mode,
    out: Path,
    args,
    stack: ExitStack,
    concurrency: int,
    problems: Iterator[arithmetic.Problem],
) -> Trained:
    """Start ``proxrl train`` on ``run`` (stopped by ``stack``), and once its workers are up
    the agent with ``concurrency`` sessions in flight, until the trainer logged ``args.steps``
    steps. The agent is stopped then; the trainer keeps running until ``stack`` closes."""
    trainer = start_trainer(server, mode, out, args)
    stack.callback(trainer.stop)
    print("  trainer starting ...", flush=True)
    launched = time.monotonic()
    await wait_configured(client, run["id"], args.batch_size, trainer)
    started = time.time()
    print(f"  trainer ready in {time.monotonic() - launched:.1f}s; agent started", flush=True)
    agent = MathAgent(
        client, http, run["model"], run["id"], problems,
        concurrency=concurrency, group_size=args.group_size,
        max_tokens=args.max_tokens, temperature=TEMPERATURE, seed=args.seed,
    )  # fmt: skip
    running = asyncio.create_task(agent.run())
    watch = asyncio.create_task(until_trained(trainer, args.steps, args.mode_timeout))
    try:
        await asyncio.wait({running, watch}, return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            running.result()  # the agent failed: raise its error
            raise RuntimeError("the agent stopped before the trainer finished")
        watch.result()
    except Exception:
        print(tail(out / "trainer.log"), file=sys.stderr)
        raise
    finally:
        for task in (running, watch):
            task.cancel()
        await asyncio.gather(running, watch, return_exceptions=True)
    return Trained(trainer.steps()[: args.steps], agent.log, started, trainer)


def connect(server: LocalServer, concurrency: int) -> tuple[AsyncClient, httpx.AsyncClient]:
    """The admin client (retrying admission waits and 429s) and the HTTP pool the agent's
    sessions share, sized for ``concurrency`` sessions in flight; both to be entered."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    limits = httpx.Limits(max_connections=4 * concurrency)
    client = AsyncClient(server.url, server.admin_key, timeout=timeout, max_retries=MAX_RETRIES)
    return client, httpx.AsyncClient(timeout=timeout, limits=limits)


async def drive_mode(server: LocalServer, mode: Mode, out: Path, args, stack: ExitStack):
    client, http = connect(server, args.concurrency)
    async with client, http:
        default = next(r for r in await client.list_runs() if r["is_default"])
        model = default["model"]
        await client.update_run_config(default["id"], {"admission_wait_s": ADMISSION_WAIT_S})

        # Calibration: one batch generated with nothing else running, on a run of its own
        # (no batch size: no admission, never trained). Same problems and seeds every mode.
        calibration = await client.create_run(name="calibration")
        rounds = []
        for _ in range(2):
            agent = MathAgent(
                client, http, model, calibration["id"],
                arithmetic.problems(args.seed + 1, max_operand=MAX_OPERAND, length_varying=True),
                concurrency=args.concurrency, group_size=args.group_size,
                max_tokens=args.max_tokens, temperature=TEMPERATURE, seed=args.seed + 1,
            )  # fmt: skip
            started = time.monotonic()
            rounds.append((await agent.run(limit=args.batch_size), time.monotonic() - started))
        calibrated, calibration_s = rounds[-1]
        print(
            f"  calibration: {args.batch_size} sessions alone in {calibration_s:.2f}s "
            f"(warm-up round {rounds[0][1]:.2f}s), "
            f"reward {statistics.mean(calibrated.rewards):.3f}",
            flush=True,
        )

        problems = arithmetic.problems(args.seed, max_operand=MAX_OPERAND, length_varying=True)
        trained = await train_alongside(
            client, http, server, default, mode, out, args, stack, args.concurrency, problems
        )
    return ModeResult(
        mode=mode,
        wall_s=trained.wall_s,
        steps=trained.steps,
        agent=trained.agent,
        calibration_s=calibration_s,
        calibration_reward=statistics.mean(calibrated.rewards),
        calibration_tokens=sum(calibrated.completion_tokens),
    )


def run_mode(model_dir: Path, mode: Mode, args) -> ModeResult:
    out = LOG_DIR / mode.key
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with ExitStack() as stack:
        started = time.monotonic()
        server = LocalServer(str(model_dir), out / "server")
        stack.callback(server.stop)
        print(f"  proxrl serve up in {time.monotonic() - started:.1f}s at {server.url}", flush=True)
        result = asyncio.run(drive_mode(server, mode, out, args, stack))
    print(
        f"  {result.wall_s:.1f}s, {result.trained_tokens} tokens trained "
        f"({result.tokens_per_s:.0f} tok/s), "
        f"final reward {result.final_reward(args.final_steps):.3f}, "
        f"train+publish {result.train_s:.1f}s, agent busy {result.agent.busy_s:.1f}s",
        flush=True,
    )
    return result


# --- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    gen_s: float  # one batch generated alone
    train_s: float  # one step trained and published alone (the sync run's mean)

    @property
    def speedup(self) -> float:
        return (self.gen_s + self.train_s) / max(self.gen_s, self.train_s)


def bound_of(results: list[ModeResult]) -> Bound:
    sync = results[0]
    return Bound(
        gen_s=statistics.median(r.calibration_s for r in results),
        train_s=sync.train_s / len(sync.steps),
    )


def markdown_table(results: list[ModeResult], bound: Bound, args) -> str:
    sync = results[0]
    lines = [
        f"| mode | wall s | trained tokens | trained tok/s | vs sync | final reward "
        f"(last {args.final_steps} steps) | staleness (mean) | train+publish s | generating s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode.key}: {r.mode.label} | {r.wall_s:.1f} | {r.trained_tokens} "
            f"| {r.tokens_per_s:.0f} | {r.tokens_per_s / sync.tokens_per_s:.2f}x "
            f"| {r.final_reward(args.final_steps):.3f} | {r.staleness:.2f} | {r.train_s:.1f} "
            f"| {r.agent.busy_s:.1f} |"
        )
    lines.append(
        f"| ideal overlap bound: (gen + train) / max(gen, train), gen {bound.gen_s:.2f}s + "
        f"train {bound.train_s:.2f}s per step | | | | **{bound.speedup:.2f}x** | | | | |"
    )
    return "\n".join(lines)


def verdict(results: list[ModeResult], args) -> list[str]:
    sync = {r.mode.key: r for r in results}["sync"]
    lines = []
    for r in results[1:]:
        speedup = r.tokens_per_s / sync.tokens_per_s
        gap = r.final_reward(args.final_steps) - sync.final_reward(args.final_steps)
        met = speedup >= TARGET_SPEEDUP and abs(gap) <= TARGET_REWARD_GAP
        lines.append(
            f"target for {r.mode.key} (>= {TARGET_SPEEDUP}x sync throughput, final reward within "
            f"{TARGET_REWARD_GAP} of sync): {'met' if met else 'MISSED'} "
            f"({speedup:.2f}x, reward {gap:+.3f})"
        )
    return lines


def notes(results: list[ModeResult], bound: Bound, args) -> list[str]:
    sync = results[0]
    start_reward = statistics.mean(r.calibration_reward for r in results)
    lines = [
        f"{args.steps} steps x {args.batch_size} sessions (GRPO groups of {args.group_size}) per "
        f"mode; {args.concurrency} sessions in flight; lr {args.lr}; max_tokens {args.max_tokens}; "
        f"{args.ppo_minibatches} PPO minibatch(es) per step",
        "wall: from the agent's start (the trainer's workers up) to the trainer's last step; "
        "trained tok/s = sum of metrics.jsonl trained_tokens / wall",
        f"reward of the warmed-up model (calibration batches, every mode): {start_reward:.3f}",
        f"gen: {args.batch_size} sessions generated with nothing else running (median over the "
        "modes' calibration rounds: "
        + ", ".join(f"{r.calibration_s:.2f}s" for r in results)
        + f"); train: the sync run's mean train+publish per step ({bound.train_s:.2f}s)",
        f"sync wall {sync.wall_s:.1f}s vs {args.steps} x (gen + train) = "
        f"{args.steps * (bound.gen_s + bound.train_s):.1f}s; the rest is claim polling, "
        "admission wake-ups and the engine's weight swaps",
        "train+publish s: sum over steps; in the async modes it rises because generation "
        "competes with the trainer for the CPUs",
        "generating s: time with at least one session in flight between the agent's start and "
        "the trainer's last step (or a little after)",
    ]
    for r in results:
        tokens = r.agent.completion_tokens
        lines.append(
            f"{r.mode.key}: {len(tokens)} sessions generated, completion tokens mean "
            f"{statistics.mean(tokens):.1f}, max {max(tokens)}; agent reward "
            f"{statistics.mean(r.agent.rewards):.3f}; per-step reward_mean "
            + " ".join(f"{s['reward_mean']:.2f}" for s in r.steps)
        )
    return lines


def machine() -> str:
    import torch

    return (
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.platform()}"
    )


def warm_model(args) -> Path:
    from trainer.warmup import cached_warm_start

    problems = arithmetic.generate(
        WARMUP_EXAMPLES, seed=1000, max_operand=MAX_OPERAND, length_varying=True
    )
    examples = [(arithmetic.messages(p), arithmetic.solution(p)) for p in problems]
    return cached_warm_start(CACHE_DIR, examples, seed=0, threads=2, **WARMUP)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=10, help="Training steps per mode.")
    p.add_argument("--batch-size", type=positive_int, default=64, help="Sessions per step.")
    p.add_argument("--group-size", type=positive_int, default=8, help="Sessions per GRPO group.")
    p.add_argument(
        "--concurrency", type=positive_int, default=64, help="Sessions in flight at once."
    )
    p.add_argument("--staleness", type=positive_int, default=4, help="max_staleness when async.")
    p.add_argument("--lr", type=float, default=5e-4, help="The trainer's learning rate.")
    p.add_argument(
        "--ppo-minibatches",
        type=positive_int,
        default=1,
        help="Optimizer steps per training step (more: training weighs more against generation).",
    )
    p.add_argument("--max-tokens", type=positive_int, default=80, help="max_tokens per answer.")
    p.add_argument("--final-steps", type=positive_int, default=4, help="Steps in final reward.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mode-timeout", type=float, default=300.0, help="Seconds one mode may train at most."
    )
    p.add_argument("--only", choices=["sync", "async", "async-plain"], action="append")
    args = p.parse_args()
    if args.batch_size % args.group_size or args.concurrency % args.group_size:
        p.error("--batch-size and --concurrency must be multiples of --group-size")
    if args.final_steps > args.steps:
        p.error("--final-steps must be at most --steps")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: everything stops
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("proxrl.warmup").setLevel(logging.INFO)
    started = time.monotonic()
    host = machine()
    print(f"machine: {host}")
    model_dir = warm_model(args)
    print(f"model: {model_dir} (warm-up {time.monotonic() - started:.0f}s)", flush=True)
    results = []
    for mode in modes(args.staleness):
        if args.only and mode.key not in args.only:
            continue
        print(f"{mode.key}: {mode.label}", flush=True)
        results.append(run_mode(model_dir, mode, args))
    if not results or results[0].mode.key != "sync":
        return  # a partial run (--only without sync): nothing to compare against
    bound = bound_of(results)
    table = markdown_table(results, bound, args)
    lines = [*verdict(results, args), *notes(results, bound, args)]
    lines.append(f"total {time.monotonic() - started:.0f}s")
    print(f"\n{table}\n\n" + "\n".join(lines))
    today = datetime.date.today().isoformat()
    header = [f"# bench/async_vs_sync.py, {today}", "", f"machine: {host}", ""]
    header += [f"args: `{vars(args)}`", "", table, ""]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"async-vs-sync-{today}.md"
    path.write_text("\n".join(header + [f"- {line}" for line in lines]) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
