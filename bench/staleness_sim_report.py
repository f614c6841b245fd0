"""The staleness simulator's report: its grid of results as a Markdown table and a plot.

``bench/staleness_sim.py`` runs the cells and writes what this module renders; this module knows
nothing of how a cell is simulated, only the figures each ``Result.totals()`` gives.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.staleness_sim import Result, Workload

# (policy, group size, eta) -> one result per seed
Grid = dict[tuple[str, int, int], list["Result"]]


def summarize(results: list[Result]) -> dict[str, Any]:
    """A cell's figures over its seeds: mean, min and max of each."""
    totals = [r.totals() for r in results]
    out: dict[str, Any] = {}
    for key, value in totals[0].items():
        if isinstance(value, int | float):
            values = [t[key] for t in totals]
            out[key] = (statistics.fmean(values), min(values), max(values))
    reasons: Counter[str] = Counter()
    for t in totals:
        reasons.update(t["drop_reasons"])
    out["drop_reasons"] = dict(reasons)
    return out


def fmt_range(value: tuple[float, float, float], spec: str, scale: float = 1.0) -> str:
    mean, low, high = (v * scale for v in value)
    if f"{low:{spec}}" == f"{high:{spec}}":
        return f"{mean:{spec}}"
    return f"{mean:{spec}} ({low:{spec}}-{high:{spec}})"


HEADER = (
    "| policy | group | η | trained % | sessions dropped % | why dropped | staleness mean / p99 / "
    "max | turns kept / sampled | backlog end (max) / (η+1)·B | trained tok/s |"
)


def table_row(policy: str, group: int, eta: int, batch: int, s: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["drop_reasons"].items())) or "-"
    return (
        f"| {policy} | {group} | {eta} | {fmt_range(s['trained_share'], '.0f', 100)} "
        f"| {fmt_range(s['dropped_share'], '.0f', 100)} | {reasons} "
        f"| {s['staleness_mean'][0]:.2f} / {s['staleness_p99'][0]:.1f} / "
        f"{s['staleness_max'][2]:.0f} "
        f"| {s['turns_kept'][0]:.1f} / {s['turns_sampled'][0]:.1f} "
        f"| {s['backlog_end'][0]:.0f} ({s['backlog_max'][2]:.0f}) / {(eta + 1) * batch} "
        f"| {s['trained_tokens_per_s'][0]:.1f} |"
    )


def report(grid: Grid, args: argparse.Namespace, w: Workload) -> str:
    """The grid's table, in Markdown, under what was simulated (``args``, the workload ``w``)."""
    lines = [
        "# Staleness simulator: what today's admission, claims and staleness rule train",
        "",
        f"`bench/staleness_sim.py` (`{' '.join(args.argv) or 'defaults'}`): batch "
        f"{args.batch_size}, {args.steps} steps of {args.step_s:g} s, {args.seeds} seed(s); "
        f"turns per session lognormal (median {w.turns_median:g}, sigma {w.turns_sigma:g}, "
        f"clipped {w.turns_min}-{w.turns_max}), {w.gen_s:g} s of generation per turn "
        f"({w.tokens_per_s:g} tokens/s), a tool call after each turn but the last (lognormal, "
        f"median {w.tool_s:g} s, sigma {w.tool_sigma:g}); agents always want more sessions"
        + (f" (at most {w.max_open} open)" if w.max_open else "")
        + ".",
        "",
        "Trained %: tokens trained of the tokens the trainer judged (the rest were masked "
        "stale or in dropped sessions); staleness of trained tokens in updates; turns: mean "
        "turns of trained sessions against all judged ones; backlog: sessions admitted (not "
        "dropped) and not trained, after the last step (its largest), against the bound's "
        "(η+1)·B. Mean over seeds (min-max); why dropped: sessions, summed over seeds.",
        "",
        HEADER,
        "|" + "---|" * 10,
    ]
    for (policy, group, eta), results in grid.items():
        lines.append(table_row(policy, group, eta, args.batch_size, summarize(results)))
    return "\n".join(lines) + "\n"


def plot(grid: Grid, args: argparse.Namespace, path: Path) -> None:
    """The share trained against η per group size, and one η's backlog over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, backlog) = plt.subplots(1, 2, figsize=(12, 4.5))
    policies = sorted({p for p, _, _ in grid})
    for policy in policies:
        for group in args.groups:
            etas = [e for e in args.etas if (policy, group, e) in grid]
            values = [100 * summarize(grid[(policy, group, e)])["trained_share"][0] for e in etas]
            label = f"group {group}" + (f" ({policy})" if len(policies) > 1 else "")
            share.plot(etas, values, marker="o", label=label)
    share.set_xscale("symlog", linthresh=1)
    share.set_xticks(args.etas, [str(e) for e in args.etas])
    share.set(xlabel="max staleness η", ylabel="sampled tokens trained (%)", ylim=(0, 105))
    share.set_title("Share of judged tokens trained")
    share.legend()
    eta = 4 if 4 in args.etas else args.etas[len(args.etas) // 2]
    for group in args.groups:
        key = (policies[0], group, eta)
        if key in grid:
            series = grid[key][0].backlog
            backlog.plot(
                [s for _, s, _ in series], [b for _, _, b in series], label=f"group {group}"
            )
    backlog.axhline((eta + 1) * args.batch_size, color="grey", ls="--", label="(η+1)·B")
    backlog.set(xlabel="step", ylabel="sessions admitted, not trained")
    backlog.set_title(f"Admitted-but-untrained backlog, η = {eta} (seed 0)")
    backlog.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
