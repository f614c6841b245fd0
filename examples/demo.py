"""`proxrl demo` (what `make demo` runs): watch an agent learn arithmetic through proxrl.

1. The tiny model gets a short supervised warm-up on a synthetic addition task, so it starts
   partly right (cached: a second run starts at once).
2. `proxrl serve` serves it; `proxrl train` trains it with asynchronous decoupled PPO
   (max_staleness > 0), publishing each new version into the engine while it serves.
3. The math agent (examples/agents/math_agent.py) runs many concurrent sessions through the
   real proxy with the stock openai SDK, in GRPO groups, and posts reward 1 for exact sums.
4. Beside it, a held-out set of problems the agent never trains on, and a seen set of problems
   it does (examples/agents/heldout.py), are answered greedily in evaluation sessions: at
   version 0, every ``--eval-every`` versions, and at the end, each answer counted under the
   policy version that gave it.
5. A live table shows policy version, reward, held-out and seen accuracy, staleness,
   sessions/s and trained tokens/s; at the end a summary (also `summary.json`) and a plot of
   reward and accuracy against time and version. The summary's accuracy per version is checked
   against the server's own (`GET /rl/runs/{id}`, its `eval` figures).
6. The dashboard's address and admin key are printed once the server is up; at a terminal
   (or with --keep-serving) the server stays up after the summary of a demo that ended by
   itself, for the dashboard, until Ctrl-C.

Ctrl-C stops everything cleanly: the trainer checkpoints, then the final evaluation runs, the
summary is printed, and the demo exits (130); a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from client_sdk import AsyncClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import arithmetic  # noqa: E402  (examples/agents, on the path above)
import heldout  # noqa: E402
from math_agent import MathAgent  # noqa: E402
from warm_start import CACHE_DIR, warm_model  # noqa: E402

log = logging.getLogger("proxrl.demo")

# Sessions in the rolling reward and in the start and end figures: 32 problems of 8 sessions,
# enough that the figures are not one lucky batch (every problem has its own difficulty).
WINDOW = 256
MAX_TOKENS = 16  # "4+7=11" is 6 tokens; room for a wrong, longer answer
NAMES = {heldout.HELDOUT: "held-out", heldout.SEEN: "seen"}  # the evaluation sets, for people
NO_DATA = "—"  # a figure with nothing behind it yet, rather than a misleading 0
# Why the held-out line does not rise (docs/getting-started.md, "The demo", has the measurements).
HELDOUT_NOTE = (
    "held-out problems are never trained on: on this task RL raises greedy accuracy on the "
    "problems it practises (seen), not on held-out ones, so a flat or falling held-out line "
    "is expected"
)


@dataclass
class Outcome:
    at: float  # seconds since the agent started
    reward: float
    version: int  # the policy version served when the session started


@dataclass(frozen=True)
class Evaluation:
    """One pass over both evaluation sets (held-out and seen)."""

    at: float  # seconds since the start, when its last answer came
    answers: list[heldout.Answer]

    def accuracy(self, task_id: str) -> float:
        return _mean([a.reward for a in self.answers if a.task_id == task_id])

    @property
    def versions(self) -> tuple[int, int]:
        """The lowest and highest answering version (they differ when the weights changed
        while it ran)."""
        versions = [answer.version for answer in self.answers]
        return min(versions), max(versions)

    @property
    def label(self) -> str:
        low, high = self.versions
        return f"v{low}" if low == high else f"v{low}-{high}"


@dataclass
class Board:
    """What the live table and the summary show."""

    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    version: int = 0
    steps: list[dict] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    server_eval: dict[str, list[dict]] | None = None  # GET /rl/runs/{id}'s, by set, at the end
    seconds: float | None = None  # how long the agent trained

    def add(self, reward: float) -> None:
        self.outcomes.append(Outcome(time.monotonic() - self.started, reward, self.version))
        self.recent.append(reward)

    def add_evaluation(self, answers: list[heldout.Answer]) -> None:
        self.evaluations.append(Evaluation(time.monotonic() - self.started, answers))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="proxrl demo",
        description=__doc__.split("\n\n")[0],
        epilog="proxrl demo --lora: two LoRA runs learn two tasks on one engine, one rolled "
        "back mid-way (examples/demo_lora.py; its flags: proxrl demo --lora --help).",
    )
    add_training_arguments(
        p, minutes=10.0, out="demo-out", concurrency=32, batch_size=64, max_staleness=2, lr=3e-4
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=40,
        help="Policy versions between held-out evaluations (also one at the start and the end).",
    )
    p.add_argument(
        "--heldout",
        type=int,
        default=32,
        help="Problems in each evaluation set: held out (never trained on), and seen.",
    )
    args = p.parse_args(argv)
    check_training_arguments(p, args)
    if args.eval_every < 1:
        p.error("--eval-every must be at least 1")
    if not 1 <= args.heldout <= 50:
        p.error("--heldout must be 1 to 50: the two sets come from 100 problems")
    return args


def add_training_arguments(
    p: argparse.ArgumentParser,
    *,
    minutes: float,
    out: str,
    concurrency: int,
    batch_size: int,
    max_staleness: int,
    lr: float,
) -> None:
    """The flags this demo and the two-run LoRA demo (examples/demo_lora.py) share, with the
    demo's defaults."""
    p.add_argument("--minutes", type=float, default=minutes, help="Minutes of training.")
    p.add_argument("--out", type=Path, default=Path(out), help="Where results go.")
    p.add_argument("--cache", type=Path, default=CACHE_DIR, help="Warm-up cache.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--concurrency", type=int, default=concurrency, help="Sessions in flight at once, per run."
    )
    p.add_argument("--group-size", type=int, default=8, help="Sessions per GRPO group.")
    p.add_argument("--batch-size", type=int, default=batch_size, help="Sessions per training step.")
    p.add_argument(
        "--max-staleness", type=int, default=max_staleness, help="Versions a token may lag."
    )
    p.add_argument("--lr", type=float, default=lr, help="The trainer's learning rate.")
    p.add_argument(
        "--keep-serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="After the summary, keep the server (and its dashboard) up until Ctrl-C. "
        "Default: when stdin and stdout are a terminal.",
    )


def check_training_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what ``add_training_arguments``' flags cannot be, and settle --keep-serving."""
    if not args.minutes > 0:
        p.error("--minutes must be positive")
    if min(args.group_size, args.batch_size, args.concurrency) < 1:
        p.error("--group-size, --batch-size and --concurrency must be at least 1")
    if args.batch_size % args.group_size or args.concurrency % args.group_size:
        p.error("--batch-size and --concurrency must be multiples of --group-size")
    if args.max_staleness < 0:
        p.error("--max-staleness must be at least 0 (0: synchronous)")
    if args.keep_serving is None:  # a person at a terminal gets to look at the run
        args.keep_serving = sys.stdin.isatty() and sys.stdout.isatty()


# ----- the pieces ----------------------------------------------------------------------------


def start_trainer(
    server, out: Path, args: argparse.Namespace, name: str = "trainer", extra: tuple[str, ...] = ()
):
    """``proxrl train`` on the demo's flags, ``extra`` overrides after them; its output in
    ``out/<name>``, its log in ``out/<name>.log``."""
    from trainer.run import TrainerProcess

    overrides = [
        f"batch_size={args.batch_size}", f"max_staleness={args.max_staleness}",
        f"lr={args.lr}", "max_steps=0", "checkpoint_every=1000", f"seed={args.seed}",
        "claim_wait_s=0.2", f"algorithm.group_size={args.group_size}",
        "algorithm.advantage=grpo", "algorithm.ppo_minibatches=1", "optim.grad_clip=1.0",
        "optim.warmup_steps=10", *extra,
    ]  # fmt: skip
    return TrainerProcess(server, out / name, overrides, out / f"{name}.log")


def table(board: Board, args: argparse.Namespace):
    from rich.table import Table

    elapsed = time.monotonic() - board.started
    total = args.minutes * 60
    last = board.steps[-1] if board.steps else None
    recent = list(board.recent)
    start = [o.reward for o in board.outcomes[:WINDOW]]
    sessions = len(board.outcomes)
    t = Table(title=f"proxrl demo · {elapsed:.0f}s of {total:.0f}s", show_header=False)
    t.add_column(justify="right", style="bold")
    t.add_column()
    rows = [
        ("policy version", str(board.version)),
        (f"mean reward (last {WINDOW} sessions)", f"{_mean(recent):.3f}" if recent else NO_DATA),
        ("mean reward at start", f"{_mean(start):.3f}" if start else NO_DATA),
        ("held-out accuracy (greedy)", accuracy_line(board, heldout.HELDOUT)),
        ("seen accuracy (greedy)", accuracy_line(board, heldout.SEEN)),
        (
            "sessions",
            f"{sessions} ({sessions / max(elapsed, 1e-9):.1f}/s)" if sessions else NO_DATA,
        ),
        ("sessions trained", str(sum(s["sessions"] for s in board.steps)) if last else NO_DATA),
        ("trained tokens/s (last step)", f"{last['tokens_per_second']:.0f}" if last else NO_DATA),
        (
            "staleness (mean / max versions)",
            f"{last['staleness_mean']:.2f} / {last['staleness_max']}" if last else NO_DATA,
        ),
    ]
    for name, value in rows:
        t.add_row(name, value)
    return t


def accuracy_line(board: Board, task_id: str) -> str:
    if not board.evaluations:
        return "(the first evaluation is running)"
    first, last = board.evaluations[0], board.evaluations[-1]
    line = f"{last.accuracy(task_id):.3f} at {last.label}"
    if last is first:
        return line
    return f"{line} (first {first.accuracy(task_id):.3f} at {first.label})"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(board: Board, out: Path) -> dict:
    rewards = [o.reward for o in board.outcomes]
    summary = {
        "reward_start": _mean(rewards[:WINDOW]),
        "reward_end": _mean(rewards[-WINDOW:]),
        "versions_published": board.version,
        "sessions_trained": sum(s["sessions"] for s in board.steps),
        "sessions": len(rewards),
        "seconds": round(board.seconds or 0.0, 1),
        "window": WINDOW,
        "heldout": summarize_set(board, heldout.HELDOUT),
        "seen": summarize_set(board, heldout.SEEN),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summarize_set(board: Board, task_id: str) -> dict:
    """One evaluation set: its evaluations (first, last, best, each), its accuracy per
    answering version, and the server's figures for the same versions."""
    evaluations: list[dict[str, Any]] = [
        {
            "versions": list(e.versions),
            "accuracy": e.accuracy(task_id),
            "count": sum(a.task_id == task_id for a in e.answers),
            "at_s": round(e.at, 1),
        }
        for e in board.evaluations
    ]
    ours = heldout.by_version((a for e in board.evaluations for a in e.answers), task_id)
    theirs = board.server_eval[task_id] if board.server_eval is not None else None
    differences = heldout.disagreements(ours, theirs) if theirs is not None else None
    for difference in differences or []:
        log.warning("%s accuracy differs from the server's: %s", task_id, difference)
    return {
        "task_id": task_id,
        "seed": heldout.EVAL_SEED,
        "problems": evaluations[0]["count"] if evaluations else 0,
        "first": evaluations[0] if evaluations else None,
        "last": evaluations[-1] if evaluations else None,
        "best": max(evaluations, key=lambda e: e["accuracy"]) if evaluations else None,
        "evaluations": evaluations,
        "by_version": ours,
        "server_by_version": theirs,
        "server_agrees": None if differences is None else not differences,
    }


def rolling_mean(values: list[float], most: int) -> tuple[int, list[float]]:
    """The window (``most``, or a quarter of the values when that is less) and each value's
    mean over the window that ends at it: a curve that is not one lucky session."""
    window = max(1, min(most, len(values) // 4 or 1))
    return window, [_mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(board: Board, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / "reward.png"
    fig, (by_time, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    times = [o.at for o in board.outcomes]
    rewards = [o.reward for o in board.outcomes]
    window, rolling = rolling_mean(rewards, WINDOW)
    by_time.plot(times, rolling, label=f"training reward (last {window} sessions)")
    by_time.set(xlabel="seconds", ylabel="reward / accuracy", ylim=(0, 1))
    by_time.set_title("against time")
    versions = sorted({o.version for o in board.outcomes})
    means = [_mean([o.reward for o in board.outcomes if o.version == v]) for v in versions]
    by_version.plot(versions, means, marker=".", label="training reward (sampled)")
    by_version.set(xlabel="policy version", ylabel="reward / accuracy", ylim=(0, 1))
    by_version.set_title("against policy version")
    answered = [_mean([a.version for a in e.answers]) for e in board.evaluations]
    for task_id, marker in ((heldout.HELDOUT, "o"), (heldout.SEEN, "s")):
        label = f"{NAMES[task_id]} accuracy (greedy)"
        accuracy = [e.accuracy(task_id) for e in board.evaluations]
        by_time.plot([e.at for e in board.evaluations], accuracy, marker=marker, label=label)
        by_version.plot(answered, accuracy, marker=marker, label=label)
    for axes in (by_time, by_version):
        axes.legend(loc="lower right")
    fig.text(0.5, 0.01, HELDOUT_NOTE, ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # room for the note under the axes
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----- the run -------------------------------------------------------------------------------


@dataclass
class Evaluator:
    """The held-out evaluations: one before training moves, one whenever the policy is
    ``every`` versions past the last one's (beside the training agent, never stopping it), one
    at the end. One at a time."""

    board: Board
    client: AsyncClient
    http: httpx.AsyncClient
    run: dict
    sets: dict[str, list[arithmetic.Problem]]
    every: int
    running: asyncio.Task | None = None
    due_at: int = 0  # the version that starts the next one

    async def evaluate(self) -> None:
        answers = await heldout.evaluate(
            self.client, self.http, self.run["model"], self.run["id"], self.sets,
            max_tokens=MAX_TOKENS,
        )  # fmt: skip
        self.board.add_evaluation(answers)
        self.due_at = max(answer.version for answer in answers) + self.every

    def start_if_due(self, version: int) -> None:
        if self.running is not None and self.running.done():
            self.running.result()  # its error, if it failed
            self.running = None
        if self.running is None and version >= self.due_at:
            self.running = asyncio.create_task(self.evaluate())

    async def finish(self) -> None:
        """Wait for the one in flight, if any."""
        if self.running is not None:
            await self.running
            self.running = None


async def watch(
    board: Board,
    server,
    trainer,
    args: argparse.Namespace,
    agent: asyncio.Task,
    evaluator: Evaluator,
    stop: asyncio.Event,
) -> None:
    """Refresh the live table every second, starting evaluations when due, until time is up,
    the agent stops, or Ctrl-C."""
    from rich.live import Live

    deadline = board.started + args.minutes * 60
    async with AsyncClient(server.url, server.admin_key, timeout=30) as client:
        with Live(table(board, args), refresh_per_second=2) as live:
            while time.monotonic() < deadline and not agent.done() and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                if trainer.exited() is not None:
                    raise RuntimeError(f"proxrl train stopped; see {trainer.log_path}")
                board.version = (await client.get_run(evaluator.run["id"]))["policy_version"]
                board.steps = trainer.steps()
                evaluator.start_if_due(board.version)
                live.update(table(board, args))


async def run_agent(board: Board, client: AsyncClient, run: dict, args: argparse.Namespace) -> None:
    """The math agent, ``--concurrency`` sessions in flight, until cancelled; it never sees a
    held-out problem."""
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:
        await wait_configured(client, run["id"])
        held = heldout.evaluation_sets(args.heldout)[heldout.HELDOUT]
        training = heldout.training_problems(arithmetic.problems(args.seed), held)
        agent = MathAgent(
            client,
            http,
            run["model"],
            run["id"],
            training,
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


async def demo(board: Board, server, trainer, args: argparse.Namespace) -> bool:
    """Evaluate, train while evaluating, stop the trainer, evaluate the last version, read the
    server's held-out figures. True when Ctrl-C ended the training (a second Ctrl-C stops
    everything at once: KeyboardInterrupt)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    limits = httpx.Limits(max_connections=2 * args.heldout + 8)
    async with (
        AsyncClient(server.url, server.admin_key, max_retries=1000, timeout=300) as client,
        httpx.AsyncClient(limits=limits, timeout=300) as http,
    ):
        run: dict[str, Any] = dict(next(r for r in await client.list_runs() if r["is_default"]))
        sets = heldout.evaluation_sets(args.heldout)
        evaluator = Evaluator(board, client, http, run, sets, args.eval_every)
        await evaluator.evaluate()  # before any training session: the policy has not moved
        agent = asyncio.create_task(run_agent(board, client, run, args))
        try:
            await watch(board, server, trainer, args, agent, evaluator, stop)
        finally:
            board.seconds = time.monotonic() - board.started
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C stops at once
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)
        if not agent.cancelled() and agent.exception() is not None:
            raise agent.exception()  # type: ignore[misc]
        await evaluator.finish()
        await asyncio.to_thread(trainer.stop)  # it checkpoints; the version stops moving
        board.steps = trainer.steps()
        board.version = (await client.get_run(run["id"]))["policy_version"]
        await evaluator.evaluate()  # the last version
        final = await client.get_run(run["id"])
        board.server_eval = {task: heldout.server_by_version(final, task) for task in sets}
    return stop.is_set()


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
        "the engine while it keeps serving. Watch the reward go up, and the greedy accuracy "
        f"on {args.heldout} problems it trains on (seen) and {args.heldout} it never does "
        "(held-out)."
    )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.cache.resolve(), args.seed)
    board = Board()
    with ExitStack() as stack:
        console.print(f"starting proxrl serve on {model} ...")
        server = LocalServer(str(model), out / "server")
        stack.callback(server.stop)
        trainer = start_trainer(server, out, args)
        stack.callback(trainer.stop)
        console.print(dashboard_line(server))
        console.print(f"server {server.url}; trainer log {out / 'trainer.log'}")
        board = Board()
        try:
            interrupted = asyncio.run(demo(board, server, trainer, args))
        except KeyboardInterrupt:
            interrupted = True
            console.print("\nstopping (Ctrl-C) ...")
        if board.seconds is None:
            board.seconds = time.monotonic() - board.started
        trainer.stop()
        board.steps = trainer.steps()
        return finish(board, out, console, server, args.keep_serving, interrupted)


def dashboard_line(server) -> str:
    """Where the dashboard is and how to log in: for the person at the terminal only (the
    admin key never goes into a log file)."""
    return f"dashboard at {server.url}/admin (log in with the admin key {server.admin_key})"


def report(board: Board, out: Path, console) -> None:
    """The summary: ``summary.json``, the plot, and its lines on the console."""
    summary = summarize(board, out)
    image = plot(board, out) if board.outcomes else None
    console.print(
        f"reward {summary['reward_start']:.3f} → {summary['reward_end']:.3f} "
        f"(first and last {WINDOW} sessions) · {summary['versions_published']} versions "
        f"published · {summary['sessions_trained']} sessions trained · {board.seconds:.0f}s"
    )
    console.print(accuracy_report(summary["heldout"]))
    console.print(accuracy_report(summary["seen"]))
    console.print(f"({HELDOUT_NOTE})", style="dim")
    console.print(f"summary: {out / 'summary.json'}" + (f" · plot: {image}" if image else ""))


def finish(board: Board, out: Path, console, server, keep_serving: bool, interrupted: bool) -> int:
    """The summary, then the server kept up for the dashboard if ``keep_serving`` and the demo
    ended by itself: a Ctrl-C asked the demo to end, not to wait for another. The exit status
    (130 after a Ctrl-C)."""
    report(board, out, console)
    if interrupted:
        return 130
    if keep_serving:
        serve_until_interrupted(server, console)
    return 0


def serve_until_interrupted(server, console) -> None:
    """Keep the server up, its run on the dashboard, until Ctrl-C (the trainer has stopped)."""
    console.print(f"{dashboard_line(server)}; Ctrl-C to stop")
    try:
        while server.process.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        return
    console.print(f"the server stopped by itself; see {server.log_path}")


def accuracy_report(figures: dict) -> str:
    if figures["first"] is None:
        return f"{NAMES[figures['task_id']]} accuracy: no evaluation finished"
    first, last, best = figures["first"], figures["last"], figures["best"]
    agrees = {True: "the server agrees", False: "the server DISAGREES (see the log)"}
    return (
        f"{NAMES[figures['task_id']]} accuracy (greedy, {figures['problems']} problems) "
        f"{first['accuracy']:.3f} "
        f"(v{first['versions'][1]}) → {last['accuracy']:.3f} (v{last['versions'][1]}), best "
        f"{best['accuracy']:.3f} (v{best['versions'][1]}) · {len(figures['evaluations'])} "
        f"evaluations · {agrees.get(figures['server_agrees'], 'not checked with the server')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
