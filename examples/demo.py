"""`proxrl demo` (what `make demo` runs): watch an agent learn arithmetic through proxrl.

1. The tiny model gets a short supervised warm-up on a synthetic addition task, so it starts
   partly right (cached: a second run starts at once).
2. `proxrl serve` serves it; `proxrl train` trains it with asynchronous decoupled PPO
   (max_staleness > 0), publishing each new version into the engine while it serves.
3. The math agent (examples/agents/math_agent.py) runs many concurrent sessions through the
   real proxy with the stock openai SDK, in GRPO groups, and posts reward 1 for exact sums.
4. A live table shows policy version, reward, staleness, sessions/s and trained tokens/s; at
   the end a summary (also `summary.json`) and a plot of reward against time and version.

Ctrl-C stops everything cleanly (the trainer checkpoints first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import arithmetic  # noqa: E402  (examples/agents, on the path above)
from math_agent import MathAgent  # noqa: E402

log = logging.getLogger("proxrl.demo")

# The warm-up stops part-way: on this task the tiny model's sampled accuracy climbs from ~0.1
# at 120 steps to ~0.6 at 200 (measured at temperature 1), so 180 steps leave it partly right.
WARMUP = {"size": "tiny", "steps": 180, "lr": 3e-3, "batch_size": 32}
WARMUP_EXAMPLES = 4000
# Sessions in the rolling reward and in the start and end figures: 32 problems of 8 sessions,
# enough that the figures are not one lucky batch (every problem has its own difficulty).
WINDOW = 256
MAX_TOKENS = 16  # "4+7=11" is 6 tokens; room for a wrong, longer answer


@dataclass
class Outcome:
    at: float  # seconds since the agent started
    reward: float
    version: int  # the policy version served when the session started


@dataclass
class Board:
    """What the live table and the summary show."""

    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    version: int = 0
    steps: list[dict] = field(default_factory=list)

    def add(self, reward: float) -> None:
        self.outcomes.append(Outcome(time.monotonic() - self.started, reward, self.version))
        self.recent.append(reward)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proxrl demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="How long the agent trains.")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="Where results go.")
    p.add_argument("--cache", type=Path, default=ROOT / ".proxrl-cache", help="Warm-up cache.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=32, help="Sessions in flight at once.")
    p.add_argument("--group-size", type=int, default=8, help="Sessions per GRPO group.")
    p.add_argument("--batch-size", type=int, default=64, help="Sessions per training step.")
    p.add_argument("--max-staleness", type=int, default=2, help="Versions a token may lag.")
    p.add_argument("--lr", type=float, default=3e-4, help="The trainer's learning rate.")
    args = p.parse_args(argv)
    if not args.minutes > 0:
        p.error("--minutes must be positive")
    if min(args.group_size, args.batch_size, args.concurrency) < 1:
        p.error("--group-size, --batch-size and --concurrency must be at least 1")
    if args.batch_size % args.group_size or args.concurrency % args.group_size:
        p.error("--batch-size and --concurrency must be multiples of --group-size")
    if args.max_staleness < 0:
        p.error("--max-staleness must be at least 0 (0: synchronous)")
    return args


# ----- the pieces ----------------------------------------------------------------------------


def warm_model(cache: Path, seed: int) -> Path:
    """The tiny model after a short supervised warm-up on the task (cached)."""
    from trainer.warmup import cached_warm_start

    examples = arithmetic.warmup_examples(WARMUP_EXAMPLES, seed=1000 + seed)
    return cached_warm_start(cache, examples, seed=seed, threads=2, **WARMUP)


def start_trainer(server, out: Path, args: argparse.Namespace):
    from trainer.run import TrainerProcess

    overrides = [
        f"batch_size={args.batch_size}", f"max_staleness={args.max_staleness}",
        f"lr={args.lr}", "max_steps=100000", "checkpoint_every=1000", f"seed={args.seed}",
        "claim_wait_s=0.2", f"algorithm.group_size={args.group_size}",
        "algorithm.advantage=grpo", "algorithm.ppo_minibatches=1", "optim.grad_clip=1.0",
        "optim.warmup_steps=10",
    ]  # fmt: skip
    return TrainerProcess(server, out / "trainer", overrides, out / "trainer.log")


def table(board: Board, args: argparse.Namespace):
    from rich.table import Table

    elapsed = time.monotonic() - board.started
    total = args.minutes * 60
    last = board.steps[-1] if board.steps else {}
    recent = list(board.recent)
    start = [o.reward for o in board.outcomes[:WINDOW]]
    t = Table(title=f"proxrl demo · {elapsed:.0f}s of {total:.0f}s", show_header=False)
    t.add_column(justify="right", style="bold")
    t.add_column()
    rows = [
        ("policy version", str(board.version)),
        (f"mean reward (last {WINDOW} sessions)", f"{_mean(recent):.3f}"),
        ("mean reward at start", f"{_mean(start):.3f}"),
        ("sessions", f"{len(board.outcomes)} ({len(board.outcomes) / max(elapsed, 1e-9):.1f}/s)"),
        ("sessions trained", str(sum(s["sessions"] for s in board.steps))),
        ("trained tokens/s (last step)", f"{last.get('tokens_per_second', 0):.0f}"),
        (
            "staleness (mean / max versions)",
            f"{last.get('staleness_mean', 0):.2f} / {last.get('staleness_max', 0)}",
        ),
    ]
    for name, value in rows:
        t.add_row(name, value)
    return t


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(board: Board, seconds: float, out: Path) -> dict:
    rewards = [o.reward for o in board.outcomes]
    summary = {
        "reward_start": _mean(rewards[:WINDOW]),
        "reward_end": _mean(rewards[-WINDOW:]),
        "versions_published": board.version,
        "sessions_trained": sum(s["sessions"] for s in board.steps),
        "sessions": len(rewards),
        "seconds": round(seconds, 1),
        "window": WINDOW,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def plot(board: Board, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / "reward.png"
    fig, (by_time, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    times = [o.at for o in board.outcomes]
    rewards = [o.reward for o in board.outcomes]
    window = max(1, min(WINDOW, len(rewards) // 4 or 1))
    rolling = [_mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    by_time.plot(times, rolling)
    by_time.set(xlabel="seconds", ylabel=f"mean reward (last {window} sessions)", ylim=(0, 1))
    by_time.set_title("reward against time")
    versions = sorted({o.version for o in board.outcomes})
    means = [_mean([o.reward for o in board.outcomes if o.version == v]) for v in versions]
    by_version.plot(versions, means, marker="o")
    by_version.set(xlabel="policy version", ylabel="mean reward", ylim=(0, 1))
    by_version.set_title("reward against policy version")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----- the run -------------------------------------------------------------------------------


async def watch(board: Board, server, trainer, args: argparse.Namespace, agent: asyncio.Task):
    """Refresh the live table every second until time is up or the agent stops."""
    from rich.live import Live

    from client_sdk import AsyncClient

    deadline = board.started + args.minutes * 60
    async with AsyncClient(server.url, server.admin_key, timeout=30) as client:
        run = next(r for r in await client.list_runs() if r["is_default"])
        with Live(table(board, args), refresh_per_second=2) as live:
            while time.monotonic() < deadline and not agent.done():
                await asyncio.sleep(1.0)
                if trainer.exited() is not None:
                    raise RuntimeError(f"proxrl train stopped; see {trainer.log_path}")
                board.version = (await client.get_run(run["id"]))["policy_version"]
                board.steps = trainer.steps()
                live.update(table(board, args))


async def run_agent(board: Board, server, args: argparse.Namespace) -> None:
    """The math agent, ``--concurrency`` sessions in flight, until cancelled."""
    import httpx

    from client_sdk import AsyncClient

    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with (
        AsyncClient(server.url, server.admin_key, max_retries=1000, timeout=300) as client,
        httpx.AsyncClient(limits=limits, timeout=300) as http,
    ):
        run = next(r for r in await client.list_runs() if r["is_default"])
        await wait_configured(client, run["id"])
        agent = MathAgent(
            client,
            http,
            run["model"],
            run["id"],
            arithmetic.problems(args.seed),
            concurrency=args.concurrency,
            group_size=args.group_size,
            max_tokens=MAX_TOKENS,
            seed=args.seed,
            on_episode=lambda episode: board.add(episode.reward),
        )
        await agent.run()


async def wait_configured(client, run_id: str) -> None:
    """Until the trainer has set the run's batch size (its workers are up): sessions admitted
    before that would not be bounded by the staleness limit."""
    while not (await client.get_run(run_id))["config"].get("batch_size"):
        await asyncio.sleep(0.5)


async def demo(board: Board, server, trainer, args: argparse.Namespace) -> None:
    agent = asyncio.create_task(run_agent(board, server, args))
    try:
        await watch(board, server, trainer, args, agent)
    finally:
        agent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent
    if agent.done() and not agent.cancelled() and agent.exception() is not None:
        raise agent.exception()  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    from contextlib import ExitStack

    from rich.console import Console

    from trainer.run import LocalServer

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("proxrl.warmup").setLevel(logging.INFO)  # its progress, rate and ETA
    console = Console()
    console.print(
        "[bold]proxrl demo[/]: a tiny model that half-knows addition answers many concurrent "
        "agent sessions through the proxy; each exact sum earns reward 1; the trainer turns "
        f"those rewards into new weights every {args.batch_size} sessions and swaps them into "
        "the engine while it keeps serving. Watch the reward go up."
    )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.cache.resolve(), args.seed)
    board = Board()
    interrupted = False
    with ExitStack() as stack:
        console.print(f"starting proxrl serve on {model} ...")
        server = LocalServer(str(model), out / "server")
        stack.callback(server.stop)
        trainer = start_trainer(server, out, args)
        stack.callback(trainer.stop)
        console.print(f"server {server.url}; trainer log {out / 'trainer.log'}")
        board = Board()
        try:
            asyncio.run(demo(board, server, trainer, args))
        except KeyboardInterrupt:
            interrupted = True
            console.print("\nstopping (Ctrl-C) ...")
        seconds = time.monotonic() - board.started
        trainer.stop()
        board.steps = trainer.steps()
    summary = summarize(board, seconds, out)
    image = plot(board, out) if board.outcomes else None
    console.print(
        f"reward {summary['reward_start']:.3f} → {summary['reward_end']:.3f} "
        f"(first and last {WINDOW} sessions) · {summary['versions_published']} versions "
        f"published · {summary['sessions_trained']} sessions trained · {seconds:.0f}s"
    )
    console.print(f"summary: {out / 'summary.json'}" + (f" · plot: {image}" if image else ""))
    return 130 if interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
