"""`proxrl demo --lora` (what `make demo-lora` runs): two LoRA runs learn two tasks on one engine
at the same time, and one of them is rolled back in the middle.

1. The tiny model gets a short supervised warm-up on addition and subtraction together
   (``warm_start.two_task_examples``, cached), so it starts partly right at both.
2. One `proxrl serve` serves it with its embedded engine. Two runs, ``add`` and ``sub``, each
   trained as a LoRA run by its own `proxrl train`: each run's requests are served with its
   own adapter at its own version, in the same batches, and each publish loads an adapter
   beside the others without a pause.
3. The math agent (examples/agents/math_agent.py) runs concurrent sessions of each run through
   the real proxy, additions for ``add`` and subtractions for ``sub``
   (examples/agents/subtraction.py), reward 1 for the exact answer.
4. Once run ``add`` serves version ``--rollback-at`` or later (k), the demo rolls it back
   ``--rollback-by`` (d) versions: ``POST /rl/runs/{id}/rollback {"version": k - d}``
   publishes version k + 1 serving version k - d's adapter; its trainer follows (it restores
   that adapter and trains on from there), so its reward falls back to that version's level
   and rises again, while run ``sub`` goes on unaffected.
5. A live table shows each run's version, reward and sessions/s; at the end each run's summary
   (also `summary.json`: reward by version, the rollback, the lineage from
   ``GET /rl/runs/{id}/versions``) and a plot of both reward curves with the rollback marked.

It ends by itself after ``--minutes`` of training. Ctrl-C stops everything cleanly: both
trainers checkpoint, the summary is printed, and the demo exits (130); a second Ctrl-C stops
at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from client_sdk import AsyncClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import arithmetic  # noqa: E402  (examples/agents, on the path above)
import demo  # noqa: E402  (examples/demo.py: the full-weight demo's pieces)
import subtraction  # noqa: E402
from math_agent import MathAgent  # noqa: E402
from warm_start import two_task_examples, warm_model  # noqa: E402

log = logging.getLogger("proxrl.demo")

# The two runs: name -> the problems its agent asks. The first is the one rolled back.
TASKS: dict[str, Callable[[int], Iterator[arithmetic.Problem]]] = {
    "add": arithmetic.problems,
    "sub": subtraction.problems,
}
ROLLED_BACK = "add"
# Sessions in the rolling reward and in each run's start and end figures: 16 groups of 8.
WINDOW = 128
MAX_TOKENS = demo.MAX_TOKENS


@dataclass
class Lane:
    """One run of the demo: its task, its run, what its agent saw, its trainer."""

    name: str
    run: dict
    board: demo.Board = field(default_factory=demo.Board)
    trainer: Any = None  # its TrainerProcess
    rollbacks: list[dict] = field(default_factory=list)  # the demo's, as it made them
    lineage: list[dict] | None = None  # GET /rl/runs/{id}/versions at the end (run: its view)

    @property
    def rewards(self) -> list[float]:
        return [outcome.reward for outcome in self.board.outcomes]

    def reward_at(self, version: int) -> float | None:
        """The mean reward of the sessions that ended while ``version`` was current."""
        rewards = [o.reward for o in self.board.outcomes if o.version == version]
        return demo._mean(rewards) if rewards else None

    def sessions_trained(self) -> int:
        """Sessions the trainer's steps trained into the run's lineage: a rollback discards
        the steps of the versions after the one it serves again, and their sessions are
        released, to be trained again."""
        discarded = {v for r in self.rollbacks for v in range(r["source"] + 1, r["from"] + 1)}
        return sum(s["sessions"] for s in self.board.steps if s["version"] not in discarded)

    def reward_until(self, last: int) -> float | None:
        """The rolling reward as the table showed it at outcome ``last``: the mean of the
        ``WINDOW`` sessions that end with it (a single version's few sessions cover a few
        problems only, too few to compare)."""
        rewards = self.rewards[max(0, last - WINDOW + 1) : last + 1]
        return demo._mean(rewards) if rewards else None

    def rollback_figures(self, rollback: dict) -> dict:
        """The rolling reward just before the rollback, once ``WINDOW`` sessions ran after
        it, and when the version it serves again was current."""
        outcomes = self.board.outcomes
        before = sum(o.at < rollback["at_s"] for o in outcomes) - 1
        under_source = [i for i, o in enumerate(outcomes) if o.version == rollback["source"]]
        return {
            "reward_before": self.reward_until(before) if before >= 0 else None,
            "reward_after": self.reward_until(before + WINDOW)
            if before + WINDOW < len(outcomes)
            else None,
            "reward_at_source": self.reward_until(under_source[-1]) if under_source else None,
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proxrl demo --lora", description=__doc__.split("\n\n")[0])
    demo.add_training_arguments(
        p, minutes=5.0, out="demo-lora-out", concurrency=16, batch_size=32, max_staleness=1, lr=3e-3
    )
    p.add_argument("--problems", type=int, default=16, help="Distinct problems each run practises.")
    p.add_argument("--lora-rank", type=int, default=8, help="Each run's adapter rank.")
    p.add_argument(
        "--rollback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"Roll run {ROLLED_BACK!r} back --rollback-by versions at --rollback-at.",
    )
    p.add_argument(
        "--rollback-at",
        type=int,
        default=24,
        help=f"The version of run {ROLLED_BACK!r} that starts the rollback.",
    )
    p.add_argument(
        "--rollback-by",
        type=int,
        default=12,
        help="Versions back: at version k, the run serves version k - this again.",
    )
    args = p.parse_args(argv)
    demo.check_training_arguments(p, args)
    if args.lora_rank < 1:
        p.error("--lora-rank must be at least 1")
    if not 1 <= args.problems <= 50:
        p.error("--problems must be 1 to 50 (subtraction has 55 problems)")
    if not 1 <= args.rollback_by < args.rollback_at:
        p.error("--rollback-by must be at least 1 and less than --rollback-at")
    return args


# ----- the pieces ----------------------------------------------------------------------------


def start_trainer(server, out: Path, args: argparse.Namespace, lane: Lane):
    """The run's `proxrl train`: the demo's trainer settings, as a LoRA run. Every published
    adapter stays on disk, so any version can be rolled back to."""
    extra = (
        f"run_id={lane.run['id']}", f"lora.rank={args.lora_rank}",
        f"lora.alpha={2 * args.lora_rank}", "publish.keep_versions=100000",
    )  # fmt: skip
    return demo.start_trainer(server, out, args, name=f"trainer-{lane.name}", extra=extra)


def table(lanes: list[Lane], started: float, args: argparse.Namespace):
    from rich.table import Table

    elapsed = time.monotonic() - started
    t = Table(title=f"proxrl demo --lora · {elapsed:.0f}s of {args.minutes * 60:.0f}s")
    for column in ("run", "version", f"reward (last {WINDOW})", f"reward (first {WINDOW})"):
        t.add_column(column, justify="right")
    t.add_column("sessions", justify="right")
    t.add_column("trained", justify="right")
    t.add_column("rollback")
    for lane in lanes:
        rewards = lane.rewards
        trained = lane.sessions_trained()
        t.add_row(
            lane.name,
            str(lane.board.version),
            f"{demo._mean(rewards[-WINDOW:]):.3f}" if rewards else demo.NO_DATA,
            f"{demo._mean(rewards[:WINDOW]):.3f}" if rewards else demo.NO_DATA,
            f"{len(rewards)} ({len(rewards) / max(elapsed, 1e-9):.1f}/s)",
            str(trained) if lane.board.steps else demo.NO_DATA,
            "; ".join(rollback_line(r) for r in lane.rollbacks) or "",
        )
    return t


def rollback_line(rollback: dict) -> str:
    return f"v{rollback['from']} → v{rollback['version']} (serves v{rollback['source']})"


async def rollback(http: httpx.AsyncClient, lane: Lane, by: int, started: float) -> None:
    """Roll the run back ``by`` versions from the one it serves now."""
    current = lane.board.version
    source = current - by
    reply = await http.post(f"/rl/runs/{lane.run['id']}/rollback", json={"version": source})
    if reply.status_code != 200:
        raise RuntimeError(f"the rollback of run {lane.name} failed: {reply.text}")
    version = reply.json()["policy_version"]
    lane.rollbacks.append(
        {
            "from": current,
            "source": source,
            "version": version,
            "at_s": round(time.monotonic() - started, 1),
        }
    )
    lane.board.version = version


async def watch(
    lanes: list[Lane],
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    agents: list[asyncio.Task],
    stop: asyncio.Event,
    started: float,
) -> None:
    """Refresh the live table every second, rolling the first run back when due, until time is
    up, an agent stops, or Ctrl-C."""
    from rich.live import Live

    deadline = started + args.minutes * 60
    with Live(table(lanes, started, args), refresh_per_second=2) as live:
        while time.monotonic() < deadline and not any(a.done() for a in agents):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            if stop.is_set():
                return
            for lane in lanes:
                if lane.trainer.exited() is not None:
                    raise RuntimeError(f"proxrl train stopped; see {lane.trainer.log_path}")
                lane.board.version = (await get(http, f"/rl/runs/{lane.run['id']}"))[
                    "policy_version"
                ]
                lane.board.steps = lane.trainer.steps()
            first = lanes[0]
            if args.rollback and not first.rollbacks and first.board.version >= args.rollback_at:
                await rollback(http, first, args.rollback_by, started)
            live.update(table(lanes, started, args))


async def get(http: httpx.AsyncClient, path: str) -> Any:
    reply = await http.get(path)
    reply.raise_for_status()
    return reply.json()


async def run_agent(lane: Lane, client: AsyncClient, args: argparse.Namespace) -> None:
    """The math agent on the lane's task, ``--concurrency`` sessions in flight, until
    cancelled."""
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:
        agent = MathAgent(
            client,
            http,
            lane.run["model"],
            lane.run["id"],
            practised(TASKS[lane.name](args.seed), args.problems),
            concurrency=args.concurrency,
            group_size=args.group_size,
            max_tokens=MAX_TOKENS,
            seed=args.seed,
            on_episode=lambda episode: lane.board.add(episode.reward),
        )
        await agent.run()


def practised(stream: Iterator[arithmetic.Problem], count: int) -> Iterator[arithmetic.Problem]:
    """The first ``count`` distinct problems of ``stream``, over and over: a run practises the
    same problems, so its reward rises within minutes (the tiny model learns each sum it
    practises; held-out ones do not follow, see examples/demo.py)."""
    chosen: dict[str, arithmetic.Problem] = {}
    while len(chosen) < count:
        problem = next(stream)
        chosen.setdefault(problem.task_id, problem)
    return itertools.cycle(list(chosen.values()))


async def create_runs(http: httpx.AsyncClient, args: argparse.Namespace) -> list[Lane]:
    """One run per task, its admission bound set from the start (the trainer sets the same),
    so the agents never sample far ahead of a trainer that is still starting."""
    bound = {"batch_size": args.batch_size, "max_staleness": args.max_staleness}
    lanes = []
    for name in TASKS:
        reply = await http.post("/rl/runs", json={"name": name, "config": bound})
        reply.raise_for_status()
        run = await get(http, f"/rl/runs/{reply.json()['id']}")
        lanes.append(Lane(name, run))
    return lanes


async def train(lanes: list[Lane], server, args: argparse.Namespace, started: float) -> bool:
    """Both agents beside both trainers until time is up; then the trainers stop and each run's
    version and lineage are read. True when Ctrl-C ended it (a second Ctrl-C stops everything
    at once: KeyboardInterrupt)."""
    for lane in lanes:  # the outcomes' times count from the same start as the rollback's
        lane.board.started = started
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with (
        AsyncClient(server.url, server.admin_key, max_retries=1000, timeout=300) as client,
        httpx.AsyncClient(base_url=server.url, headers=server.admin, timeout=300) as http,
    ):
        agents = [asyncio.create_task(run_agent(lane, client, args)) for lane in lanes]
        try:
            await watch(lanes, http, args, agents, stop, started)
        finally:
            for lane in lanes:
                lane.board.seconds = time.monotonic() - started
            loop.remove_signal_handler(signal.SIGINT)
            for agent in agents:
                agent.cancel()
            await asyncio.gather(*agents, return_exceptions=True)
        for agent in agents:
            if not agent.cancelled() and agent.exception() is not None:
                raise agent.exception()  # type: ignore[misc]
        await asyncio.gather(*(asyncio.to_thread(lane.trainer.stop) for lane in lanes))
        for lane in lanes:
            await read_lineage(http, lane)
    return stop.is_set()


async def read_lineage(http: httpx.AsyncClient, lane: Lane) -> None:
    """The run as the server reports it at the end (version, sessions by status, rollbacks)
    and its versions."""
    lane.board.steps = lane.trainer.steps()
    lane.run = await get(http, f"/rl/runs/{lane.run['id']}")
    lane.board.version = lane.run["policy_version"]
    reply = await http.get(f"/rl/runs/{lane.run['id']}/versions")
    if reply.status_code == 200:
        lane.lineage = reply.json()


def summarize(lanes: list[Lane], out: Path, seconds: float) -> dict:
    summary = {
        "seconds": round(seconds, 1),
        "window": WINDOW,
        "runs": {lane.name: summarize_run(lane) for lane in lanes},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summarize_run(lane: Lane) -> dict:
    """One run: its reward at the start and end, by version, and its rollbacks with the reward
    at each version involved."""
    rewards = lane.rewards
    versions = sorted({o.version for o in lane.board.outcomes})
    return {
        "run_id": lane.run["id"],
        "reward_start": demo._mean(rewards[:WINDOW]),
        "reward_end": demo._mean(rewards[-WINDOW:]),
        "sessions": len(rewards),
        "sessions_trained": lane.sessions_trained(),
        "steps": len(lane.board.steps),
        "policy_version": lane.board.version,
        "reward_by_version": [
            {
                "version": version,
                "count": sum(o.version == version for o in lane.board.outcomes),
                "mean": lane.reward_at(version),
            }
            for version in versions
        ],
        "rollbacks": [
            {
                **rollback,
                **lane.rollback_figures(rollback),
            }
            for rollback in lane.rollbacks
        ],
        "lineage": lane.lineage,
        "server": {key: lane.run.get(key) for key in ("policy_version", "sessions", "rollbacks")},
    }


def plot(lanes: list[Lane], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = out / "reward.png"
    fig, (by_time, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    for lane in lanes:
        outcomes = lane.board.outcomes
        rewards = lane.rewards
        window, rolling = demo.rolling_mean(rewards, WINDOW)
        (line,) = by_time.plot(
            [o.at for o in outcomes], rolling, label=f"{lane.name} (last {window} sessions)"
        )
        by_version.plot(
            [o.version for o in outcomes], rolling, color=line.get_color(), label=lane.name
        )
        for r in lane.rollbacks:
            color = line.get_color()
            mark(by_time, r["at_s"], f"{lane.name}: rollback to v{r['source']}", color)
            mark(by_version, r["version"], f"v{r['version']} = v{r['source']}", color)
    by_time.set(xlabel="seconds", ylabel="reward", ylim=(0, 1), title="against time")
    by_version.set(xlabel="policy version", ylabel="reward", ylim=(0, 1))
    by_version.set_title("against policy version")
    for axes in (by_time, by_version):
        axes.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def mark(axes, x: float, text: str, color: str) -> None:
    """A dashed line at ``x`` with ``text`` along it: where a rollback happened."""
    axes.axvline(x, color=color, linestyle="--")
    axes.annotate(text, (x, 0.98), rotation=90, fontsize=8, ha="right", va="top")


def report(lanes: list[Lane], out: Path, console, seconds: float) -> None:
    """The summary: ``summary.json``, the plot, and a line per run on the console."""
    summary = summarize(lanes, out, seconds)
    for lane in lanes:
        run = summary["runs"][lane.name]
        rollbacks = "".join(
            f" · rollback {rollback_line(r)}: reward {_figure(r['reward_before'])} before, "
            f"{_figure(r['reward_after'])} {WINDOW} sessions after "
            f"({_figure(r['reward_at_source'])} at v{r['source']})"
            for r in run["rollbacks"]
        )
        console.print(
            f"{lane.name}: reward {run['reward_start']:.3f} → {run['reward_end']:.3f} (first and "
            f"last {WINDOW} sessions) · version {run['policy_version']} · "
            f"{run['sessions_trained']} sessions trained{rollbacks}"
        )
    image = plot(lanes, out) if any(lane.board.outcomes for lane in lanes) else None
    console.print(f"summary: {out / 'summary.json'}" + (f" · plot: {image}" if image else ""))


def _figure(value: float | None) -> str:
    return demo.NO_DATA if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    from contextlib import ExitStack

    from rich.console import Console

    from trainer.run import LocalServer

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("proxrl.warmup").setLevel(logging.INFO)
    console = Console()
    console.print(
        "[bold]proxrl demo --lora[/]: one engine serves two LoRA runs of a tiny model that "
        "half-knows addition and subtraction; run 'add' is asked additions, run 'sub' "
        "subtractions, each exact answer earns reward 1, and each run's own trainer turns its "
        f"rewards into a new adapter every {args.batch_size} sessions. "
        + (
            f"At version {args.rollback_at}, run 'add' is rolled back {args.rollback_by} "
            "versions: its reward falls back, then rises again."
            if args.rollback
            else ""
        )
    )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.cache.resolve(), args.seed, examples=two_task_examples(args.seed))
    with ExitStack() as stack:
        console.print(f"starting proxrl serve on {model} ...")
        server = LocalServer(str(model), out / "server")
        stack.callback(server.stop)
        lanes = asyncio.run(setup(server, args))
        for lane in lanes:
            lane.trainer = start_trainer(server, out, args, lane)
            stack.callback(lane.trainer.stop)
        console.print(demo.dashboard_line(server))
        console.print(f"server {server.url}; trainer logs {out}/trainer-*.log")
        started = time.monotonic()
        try:
            interrupted = asyncio.run(train(lanes, server, args, started))
        except KeyboardInterrupt:
            interrupted = True
            console.print("\nstopping (Ctrl-C) ...")
        for lane in lanes:
            lane.trainer.stop()
            lane.board.steps = lane.trainer.steps()
        report(lanes, out, console, time.monotonic() - started)
        if interrupted:
            return 130
        if args.keep_serving:
            demo.serve_until_interrupted(server, console)
        return 0


async def setup(server, args: argparse.Namespace) -> list[Lane]:
    async with httpx.AsyncClient(base_url=server.url, headers=server.admin, timeout=60) as http:
        return await create_runs(http, args)


if __name__ == "__main__":
    raise SystemExit(main())
