"""AReaL's staleness ablation on one CPU: max staleness 0 to 16, decoupled against plain PPO.

The paper (arXiv 2505.24298) trains with the staleness bound eta in {0, 1, 2, 4, 8, 16}, with
and without its decoupled objective, and claims (a) asynchronous training matches the final
quality of synchronous training and (b) without the decoupled objective quality degrades as
eta grows, while the decoupled objective keeps it. This script repeats that grid on proxrl's
tiny model and the demo's task: plain additions ``a+b`` (a, b in 0..9), after the demo's cached
supervised warm-up, which leaves the model about half right at temperature 1, so there is room
to improve and room to collapse. (The length-varying chain of ``bench/async_vs_sync.py`` is no
use here: its warm start scores 0 on it, and GRPO learns nothing from groups that all fail.)
The trainer and the asyncio agent are ``bench/async_vs_sync.py``'s. One *cell* is a fresh
``proxrl serve`` (its own embedded engine and SQLite), a ``proxrl train`` with
``max_staleness=eta`` and one objective, and the agent, until a fixed number of samples
(``--steps`` x ``--batch-size`` sessions) is trained; every cell of a seed sees the same
problems in the same order.

The bound only matters if it binds. Generation is slower than training here, so an agent with
``batch_size`` sessions in flight is trained as soon as a batch arrives and its tokens are
about one version old whatever eta is: a token's staleness is about (sessions in flight) /
(batch size), capped by eta. So each cell keeps ``(eta + 1) * batch_size`` sessions in flight
(the most admission lets in; the engine decodes them all together, up to
``--max-concurrency``), with a small batch so that eta = 16 is reachable. The achieved staleness
(the trainer's ``staleness_mean`` and ``staleness_max``) is reported for every cell.

At eta = 0 with one PPO minibatch, decoupled and plain PPO compute the same update (the
proximal policy is the behaviour policy is the current one), so the synchronous cell runs once
per seed (plain PPO) and is the baseline of both columns.

Per cell: the final training reward (mean ``reward_mean`` of the last ``--final-steps`` steps);
the held-out accuracy (``--held-out`` of the 100 problems, which training never draws:
``examples/agents/heldout.py``, asked once each at temperature 0 in evaluation sessions of the
final published version after the trainer stopped); wall time from the
agent's start to the trainer's last step; trained tokens/s and its ratio to the synchronous cell
of the same seed; the achieved staleness. Aggregates are mean +- std over seeds. Results go to
``<results-dir>/staleness-ablation-<date>.md`` and ``staleness-ablation.png``; every finished
cell is appended to ``<out-dir>/cells.jsonl`` at once (``--report-only`` rebuilds the report
from it), logs and metrics to ``<out-dir>/<cell>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import secrets
import shutil
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import heldout  # noqa: E402  (examples/agents, on the path above)

from bench import async_vs_sync as base  # noqa: E402
from bench.common import positive_int  # noqa: E402
from examples.demo import warm_model  # noqa: E402
from server.common.processes import ProxyProcess  # noqa: E402

arithmetic = base.arithmetic

DEFAULT_OUT_DIR = ROOT / ".cache" / "bench" / "staleness-ablation"
ALGORITHMS = {"decoupled": True, "plain": False}  # name -> algorithm.decoupled
SERVER_START_TIMEOUT_S = 300.0
VERSION_WAIT_S = 60.0

log = logging.getLogger("bench.staleness_ablation")


class AblationServer(ProxyProcess):
    """``proxrl serve`` on loopback whose embedded engine decodes ``max_running`` requests
    together (the default 64 would cap the sessions in flight, hence the staleness)."""

    name = "proxrl serve"

    def __init__(self, model_dir: Path, data_dir: Path, max_running: int) -> None:
        super().__init__(
            model_dir,
            data_dir,
            secrets.token_urlsafe(24),
            "--engine-max-running-requests",
            str(max_running),
        )
        self.wait_ready(SERVER_START_TIMEOUT_S)


@dataclass(frozen=True)
class Cell:
    staleness: int
    algorithm: str  # a key of ALGORITHMS
    seed: int

    @property
    def key(self) -> str:
        return f"eta{self.staleness}-{self.algorithm}-seed{self.seed}"

    @property
    def mode(self) -> base.Mode:
        label = f"max staleness {self.staleness}, {self.algorithm} PPO"
        return base.Mode(self.key, label, self.staleness, ALGORITHMS[self.algorithm])


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    wall_s: float
    concurrency: int  # sessions the agent kept in flight
    rewards: list[float]  # reward_mean per step
    trained_tokens: int
    staleness_mean: float  # mean over steps of the step's mean token staleness
    staleness_max: int  # over the run
    held_out: float  # accuracy at temperature 0 after the last step
    held_out_at_final: int  # held-out answers from final_version (all, the trainer stopped)
    final_version: int

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s

    def final_reward(self, last: int) -> float:
        return statistics.mean(self.rewards[-last:])


def grid(args) -> list[Cell]:
    """Seed by seed (a seed's cells compare with each other), the synchronous cell first."""
    cells = []
    for seed in args.seeds:
        for staleness in args.staleness:
            algorithms = ["plain"] if staleness == 0 else args.algorithms
            cells += [Cell(staleness, algorithm, seed) for algorithm in algorithms]
    return cells


def concurrency_of(staleness: int, args) -> int:
    """Enough sessions in flight to fill the admission bound, in whole groups."""
    wanted = min((staleness + 1) * args.batch_size, args.max_concurrency)
    return max(args.group_size, wanted // args.group_size * args.group_size)


# --- one cell --------------------------------------------------------------------------------


async def wait_version(client, run_id: str, version: int) -> int:
    """Until the run's published version reaches ``version`` (the last step's weights)."""
    deadline = time.monotonic() + VERSION_WAIT_S
    while (current := int((await client.get_run(run_id))["policy_version"])) < version:
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {current} of {version} published in {VERSION_WAIT_S}s")
        await asyncio.sleep(0.2)
    return current


async def held_out_accuracy(client, http, run: dict, problems: list, args, version: int):
    """Each held-out problem asked once at temperature 0 in an evaluation session (never
    trained, never held back by admission); the accuracy, and how many answers came from
    ``version`` (all of them: the trainer has stopped)."""
    answers = await heldout.evaluate(
        client, http, run["model"], run["id"], problems, max_tokens=args.max_tokens
    )
    accuracy = statistics.mean(answer.reward for answer in answers)
    return accuracy, sum(answer.version == version for answer in answers)


async def drive_cell(server, cell: Cell, out: Path, held_out: list, args, stack) -> CellResult:
    concurrency = concurrency_of(cell.staleness, args)
    client, http = base.connect(server, concurrency)
    async with client, http:
        run = next(r for r in await client.list_runs() if r["is_default"])
        await client.update_run_config(run["id"], {"admission_wait_s": base.ADMISSION_WAIT_S})
        cell_args = argparse.Namespace(**{**vars(args), "seed": cell.seed})
        trained = await base.train_alongside(
            client, http, server, run, cell.mode, out, cell_args, stack, concurrency,
            heldout.training_problems(arithmetic.problems(cell.seed), held_out),
        )  # fmt: skip
        version = await wait_version(client, run["id"], args.steps)
        trained.trainer.stop()
        accuracy, at_version = await held_out_accuracy(client, http, run, held_out, args, version)
    steps = trained.steps
    return CellResult(
        cell=cell,
        wall_s=trained.wall_s,
        concurrency=concurrency,
        rewards=[s["reward_mean"] for s in steps],
        trained_tokens=sum(s["trained_tokens"] for s in steps),
        staleness_mean=statistics.mean(s["staleness_mean"] for s in steps),
        staleness_max=max(s["staleness_max"] for s in steps),
        held_out=accuracy,
        held_out_at_final=at_version,
        final_version=version,
    )


def run_cell(model_dir: Path, cell: Cell, held_out: list, args) -> CellResult:
    out = args.out_dir / cell.key
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with ExitStack() as stack:
        server = AblationServer(model_dir, out / "server", args.max_concurrency)
        stack.callback(server.stop)
        return asyncio.run(drive_cell(server, cell, out, held_out, args, stack))


def load_cells(path: Path) -> list[CellResult]:
    results = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        results.append(CellResult(**{**record, "cell": Cell(**record["cell"])}))
    return results


# --- the report ------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 3) -> str:
    """mean +- std (n); the std of one value is shown as a dash."""
    mean = statistics.mean(values)
    std = f"{statistics.stdev(values):.{digits}f}" if len(values) > 1 else "-"
    return f"{mean:.{digits}f} ± {std} (n={len(values)})"


def by_setting(results: list[CellResult]) -> dict[tuple[int, str], list[CellResult]]:
    """Cells grouped by (staleness, algorithm) in grid order, seeds together."""
    groups: dict[tuple[int, str], list[CellResult]] = {}
    for r in sorted(results, key=lambda r: (r.cell.staleness, r.cell.algorithm, r.cell.seed)):
        groups.setdefault((r.cell.staleness, r.cell.algorithm), []).append(r)
    return groups


def series(results: list[CellResult], algorithm: str) -> dict[int, list[CellResult]]:
    """One algorithm's cells by staleness, the synchronous cells (shared) at 0."""
    return {
        staleness: group
        for (staleness, name), group in by_setting(results).items()
        if name == algorithm or staleness == 0
    }


def speedups(results: list[CellResult]) -> dict[Cell, float]:
    """Each cell's trained tokens/s over its seed's synchronous cell's."""
    sync = {r.cell.seed: r for r in results if r.cell.staleness == 0}
    return {
        r.cell: r.tokens_per_s / sync[r.cell.seed].tokens_per_s
        for r in results
        if r.cell.seed in sync
    }


def markdown_table(results: list[CellResult], args) -> str:
    ratio = speedups(results)
    lines = [
        f"| max staleness | PPO | final reward (last {args.final_steps} steps) | held-out "
        "accuracy | achieved staleness: mean | max | sessions in flight | wall s "
        "| trained tok/s | vs sync |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (staleness, algorithm), group in by_setting(results).items():
        ratios = [ratio[r.cell] for r in group if r.cell in ratio]
        lines.append(
            f"| {staleness} | {'sync (both)' if staleness == 0 else algorithm} "
            f"| {spread([r.final_reward(args.final_steps) for r in group])} "
            f"| {spread([r.held_out for r in group])} "
            f"| {spread([r.staleness_mean for r in group], 2)} "
            f"| {max(r.staleness_max for r in group)} | {group[0].concurrency} "
            f"| {spread([r.wall_s for r in group], 1)} "
            f"| {spread([r.tokens_per_s for r in group], 0)} "
            f"| {spread(ratios, 2) if ratios else '-'} |"
        )
    return "\n".join(lines)


def difference(cells: list[CellResult], sync: list[CellResult], value) -> tuple[float, float]:
    """Mean of ``value`` over ``cells`` minus over ``sync``, and the seed spread of that
    difference (sqrt of the two variances; 0 where a side has one seed)."""
    a, b = [value(r) for r in cells], [value(r) for r in sync]
    variance = sum(statistics.variance(x) for x in (a, b) if len(x) > 1)
    return statistics.mean(a) - statistics.mean(b), variance**0.5


def claims(results: list[CellResult], args) -> list[str]:
    """The paper's two claims read off the grid, with the numbers they rest on."""
    sync = [r for r in results if r.cell.staleness == 0]
    if not sync:
        return ["no synchronous cell: nothing to compare with"]
    measures = {
        "held-out accuracy": lambda r: r.held_out,
        "final reward": lambda r: r.final_reward(args.final_steps),
    }
    lines = []
    for algorithm in ALGORITHMS:
        for staleness, group in series(results, algorithm).items():
            if staleness == 0:
                continue
            parts = []
            for name, value in measures.items():
                delta, sd = difference(group, sync, value)
                verdict = "within" if abs(delta) <= sd else "outside"
                parts.append(f"{name} {delta:+.3f} ({verdict} the seed spread {sd:.3f})")
            reached = statistics.mean(r.staleness_mean for r in group)
            lines.append(
                f"{algorithm} PPO, max staleness {staleness} (achieved mean {reached:.2f}, "
                f"max {max(r.staleness_max for r in group)}) against sync: " + "; ".join(parts)
            )
    return lines


def plot(results: list[CellResult], args, path: Path) -> None:
    """Reward curves against samples (one panel per algorithm, mean over seeds with a +-std
    band, a moving average of ``--smooth`` steps), and held-out accuracy against staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    etas = sorted({r.cell.staleness for r in results})
    colors = {eta: plt.get_cmap("viridis")(i / max(1, len(etas) - 1)) for i, eta in enumerate(etas)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    kernel = np.ones(args.smooth) / args.smooth
    for ax, algorithm in zip(axes, ALGORITHMS, strict=False):
        for staleness, group in series(results, algorithm).items():
            curves = np.array([np.convolve(r.rewards, kernel, mode="valid") for r in group])
            samples = (np.arange(curves.shape[1]) + args.smooth) * args.batch_size
            mean, std = curves.mean(axis=0), curves.std(axis=0)
            ax.plot(samples, mean, color=colors[staleness], label=f"η={staleness}")
            ax.fill_between(samples, mean - std, mean + std, color=colors[staleness], alpha=0.15)
        ax.set_title(f"{algorithm} PPO: training reward (η=0: sync)")
        ax.set_xlabel("samples trained")
        ax.set_ylabel(f"reward, moving mean of {args.smooth} steps")
        ax.legend(fontsize=8)
    ax = axes[2]
    for offset, (algorithm, marker) in enumerate(zip(ALGORITHMS, "os", strict=True)):
        points = series(results, algorithm)
        x = np.arange(len(points)) + (offset - 0.5) * 0.12
        accuracy = [[r.held_out for r in group] for group in points.values()]
        ax.errorbar(
            x, [np.mean(a) for a in accuracy], yerr=[np.std(a) for a in accuracy],
            marker=marker, capsize=3, label=f"{algorithm} PPO",
        )  # fmt: skip
        ax.set_xticks(np.arange(len(points)), [str(eta) for eta in points])
    ax.set_title("held-out accuracy (temperature 0), mean ± std over seeds")
    ax.set_xlabel("max staleness η")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(results: list[CellResult], args, host: str, total_s: float | None) -> None:
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    table = markdown_table(results, args)
    seeds = sorted({r.cell.seed for r in results})
    notes = [
        f"{args.steps} steps x {args.batch_size} sessions (GRPO groups of {args.group_size}) per "
        f"cell, seeds {seeds}; lr {args.lr}; max_tokens {args.max_tokens}; "
        f"{args.ppo_minibatches} PPO minibatch(es) per step; sessions in flight "
        f"min((η+1) x batch, {args.max_concurrency})",
        f"held-out: {args.held_out} of the task's 100 problems (examples/agents/heldout.py), "
        "never drawn in training, asked once each at temperature 0 in eval sessions after "
        "the last step",
        "wall: from the agent's start (trainer workers up) to the trainer's last step; "
        "trained tok/s = sum of trained_tokens / wall; vs sync: over the same seed's η=0 cell",
        "achieved staleness: mean over steps of the trainer's staleness_mean (the tokens' "
        "trained version minus generating version), and the largest staleness_max",
        "η=0 runs once per seed (plain PPO): with one PPO minibatch decoupled PPO computes the "
        "same update there",
    ]
    if total_s is not None:
        notes.append(f"total {total_s / 60:.1f} min for {len(results)} cells")
    lines = [
        f"# bench/staleness_ablation.py, {today}",
        "",
        f"machine: {host}",
        "",
        f"args: `{ {k: str(v) for k, v in vars(args).items()} }`",
        "",
        table,
        "",
        "![reward curves and held-out accuracy](staleness-ablation.png)",
        "",
        "## The paper's claims, cell by cell",
        "",
        "(a) asynchronous decoupled PPO against sync; (b) plain PPO against sync as η grows, "
        "and decoupled against it. *Within the seed spread*: the difference of the means is at "
        "most sqrt(var(cell) + var(sync)) over seeds.",
        "",
        *[f"- {line}" for line in claims(results, args)],
        "",
        "## Notes",
        "",
        *[f"- {line}" for line in notes],
        "",
    ]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"staleness-ablation-{today}.md"
    path.write_text("\n".join(lines))
    plot(results, args, args.results_dir / "staleness-ablation.png")
    print(f"\n{table}\n\n" + "\n".join(claims(results, args)))
    print(f"wrote {path} and staleness-ablation.png", flush=True)


# --- the grid --------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staleness", type=int_list, default=[0, 1, 2, 4, 8, 16], help="η values.")
    p.add_argument(
        "--algorithms", type=lambda t: t.split(","), default=list(ALGORITHMS),
        help="Comma-separated: decoupled, plain.",
    )  # fmt: skip
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="Comma-separated seeds.")
    p.add_argument("--steps", type=positive_int, default=30, help="Training steps per cell.")
    p.add_argument("--batch-size", type=positive_int, default=16, help="Sessions per step.")
    p.add_argument("--group-size", type=positive_int, default=4, help="Sessions per GRPO group.")
    p.add_argument(
        "--max-concurrency", type=positive_int, default=256,
        help="Most sessions in flight (the engine decodes this many together).",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=2e-3, help="The trainer's learning rate.")
    p.add_argument("--ppo-minibatches", type=positive_int, default=1)
    p.add_argument("--max-tokens", type=positive_int, default=16, help="max_tokens per answer.")
    p.add_argument("--final-steps", type=positive_int, default=5, help="Steps in final reward.")
    p.add_argument(
        "--held-out", type=positive_int, default=32, help="Held-out problems (of the 100)."
    )
    p.add_argument("--smooth", type=positive_int, default=5, help="Curve moving mean, steps.")
    p.add_argument("--mode-timeout", type=float, default=300.0, help="Seconds a cell may train.")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--results-dir", type=Path, default=base.RESULTS_DIR)
    p.add_argument(
        "--report-only", action="store_true", help="Rebuild the report from <out-dir>/cells.jsonl."
    )
    args = p.parse_args(argv)
    if unknown := set(args.algorithms) - set(ALGORITHMS):
        p.error(f"unknown algorithm(s) {sorted(unknown)}: choose from {list(ALGORITHMS)}")
    if min(args.staleness) < 0:
        p.error("--staleness values must be at least 0")
    if args.batch_size % args.group_size or args.max_concurrency < args.batch_size:
        p.error("--batch-size must be a multiple of --group-size and at most --max-concurrency")
    if args.final_steps > args.steps or args.smooth > args.steps:
        p.error("--final-steps and --smooth must be at most --steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: everything stops
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    host = base.machine()
    cells_path = args.out_dir / "cells.jsonl"
    if args.report_only:
        report(load_cells(cells_path), args, host, None)
        return
    started = time.monotonic()
    print(f"machine: {host}", flush=True)
    model_dir = warm_model(base.CACHE_DIR, seed=0)
    held_out = heldout.heldout_set(args.held_out)
    cells = grid(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cells_path.unlink(missing_ok=True)
    print(f"model: {model_dir}; {len(cells)} cells", flush=True)
    results: list[CellResult] = []
    grid_started = time.monotonic()
    for done, cell in enumerate(cells, start=1):
        result = run_cell(model_dir, cell, held_out, args)
        results.append(result)
        with cells_path.open("a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        elapsed = time.monotonic() - grid_started
        eta_s = elapsed / done * (len(cells) - done)
        print(
            f"[{done}/{len(cells)}] {cell.key}: {result.wall_s:.1f}s wall, "
            f"{result.tokens_per_s:.0f} tok/s, final reward "
            f"{result.final_reward(args.final_steps):.3f}, held-out {result.held_out:.3f}, "
            f"staleness mean {result.staleness_mean:.2f} max {result.staleness_max} "
            f"({result.concurrency} in flight); grid {elapsed / 60:.1f} min, "
            f"ETA {eta_s / 60:.1f} min",
            flush=True,
        )
    report(results, args, host, time.monotonic() - started)


if __name__ == "__main__":
    main()
