"""The staleness simulator's report: its grid of results as Markdown tables and a plot.

``bench/staleness_sim.py`` runs the cells and writes what this module renders; this module knows
nothing of how a cell is simulated, only the figures each ``Result.totals()`` gives and each
policy's description.
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
    "| policy | group | η | trained % | sessions dropped % | why dropped | token staleness "
    "mean / p99 / max | queue lag mean / p99 / max | queue lag > η % | turns kept / sampled "
    "| backlog end (max) / (η+1)·B | trained tok/s | stalled |"
)
COLUMNS = HEADER.count("|") - 1


def stalls(results: list[Result]) -> str:
    """How many seeds stalled (the trainer waiting for a batch nothing could fill), at which
    steps."""
    at = [r.stalled_at[1] for r in results if r.stalled_at is not None]
    if not at:
        return "-"
    return f"{len(at)}/{len(results)} (step {', '.join(str(step) for step in at)})"


def table_row(
    policy: str, group: int, eta: int, batch: int, s: dict[str, Any], stalled: str = "-"
) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["drop_reasons"].items())) or "-"
    return (
        f"| {policy} | {group} | {eta} | {fmt_range(s['trained_share'], '.1f', 100)} "
        f"| {fmt_range(s['dropped_share'], '.1f', 100)} | {reasons} "
        f"| {s['staleness_mean'][0]:.2f} / {s['staleness_p99'][0]:.1f} / "
        f"{s['staleness_max'][2]:.0f} "
        f"| {s['queue_lag_mean'][0]:.2f} / {s['queue_lag_p99'][0]:.1f} / "
        f"{s['queue_lag_max'][2]:.0f} | {fmt_range(s['lag_over_eta_share'], '.1f', 100)} "
        f"| {s['turns_kept'][0]:.2f} / {s['turns_sampled'][0]:.2f} "
        f"| {s['backlog_end'][0]:.0f} ({s['backlog_max'][2]:.0f}) / {(eta + 1) * batch} "
        f"| {s['trained_tokens_per_s'][0]:.1f} | {stalled} |"
    )


# The before/after columns: a heading and how one cell's summary reads in it.
COMPARED: list[tuple[str, Any]] = [
    ("trained %", lambda s: f"{100 * s['trained_share'][0]:.1f}"),
    ("dropped %", lambda s: f"{100 * s['dropped_share'][0]:.1f}"),
    (
        "token staleness mean / max",
        lambda s: f"{s['staleness_mean'][0]:.2f} / {s['staleness_max'][2]:.0f}",
    ),
    ("queue lag max", lambda s: f"{s['queue_lag_max'][2]:.0f}"),
    ("turns kept / sampled", lambda s: f"{s['turns_kept'][0]:.2f} / {s['turns_sampled'][0]:.2f}"),
    ("backlog max", lambda s: f"{s['backlog_max'][2]:.0f}"),
]


def comparison(grid: Grid, batch: int) -> list[str]:
    """Before (the first policy) -> after (each other one), cell by cell."""
    policies = list(dict.fromkeys(p for p, _, _ in grid))
    if len(policies) < 2:
        return []
    before = policies[0]
    lines = [
        "",
        f"## Before / after: {before} → {', '.join(policies[1:])}",
        "",
        "Means over seeds; maxima the largest over seeds.",
        "",
        "| policy | group | η | " + " | ".join(name for name, _ in COMPARED) + " | (η+1)·B |",
        "|" + "---|" * (len(COMPARED) + 4),
    ]
    for (policy, group, eta), results in grid.items():
        if policy == before or (before, group, eta) not in grid:
            continue
        old, new = summarize(grid[(before, group, eta)]), summarize(results)
        cells = [f"{show(old)} → {show(new)}" for _, show in COMPARED]
        lines.append(
            f"| {policy} | {group} | {eta} | " + " | ".join(cells) + f" | {(eta + 1) * batch} |"
        )
    return lines


def report(
    grid: Grid, args: argparse.Namespace, w: Workload, policies: dict[str, str], title: str
) -> str:
    """The grid's tables, in Markdown, under what was simulated (``args``, the workload ``w``,
    each policy's description)."""
    restarts = (
        f"; a trainer crash after every {args.restart_every}th step (checkpoint every "
        f"{args.checkpoint_every})"
        if args.restart_every
        else ""
    )
    lines = [
        f"{title}",
        "",
        f"`bench/staleness_sim.py` (`{' '.join(args.argv) or 'defaults'}`): batch "
        f"{args.batch_size}, {args.steps} steps of {args.step_s:g} s, {args.seeds} seed(s); "
        f"turns per session lognormal (median {w.turns_median:g}, sigma {w.turns_sigma:g}, "
        f"clipped {w.turns_min}-{w.turns_max}), {w.gen_s:g} s of generation per turn "
        f"({w.tokens_per_s:g} tokens/s), a tool call after each turn but the last (lognormal, "
        f"median {w.tool_s:g} s, sigma {w.tool_sigma:g}); agents always want more sessions"
        + (f" (at most {w.max_open} open)" if w.max_open else "")
        + restarts
        + ".",
        "",
        *(f"- `{name}`: {text}" for name, text in policies.items() if name in args.policies),
        "",
        "Trained %: tokens trained of the tokens the trainer judged (the rest were masked "
        "stale or in dropped sessions); token staleness of trained tokens in updates; queue "
        "lag: for each trained session, the version its step trained minus the version "
        "served when its group became claimable (whole, or timed out); turns: mean turns of "
        "trained sessions against all judged ones; backlog: what admission holds against "
        "(η+1)·B after the last step (its largest at any admission): places held under "
        "`places`, sessions admitted (not dropped) and not trained under `current`. Mean over "
        "seeds (min-max); why dropped: sessions, summed over seeds; stalled: seeds whose "
        "trainer waited for a batch that nothing could fill (no session open or trainable, "
        "admission refusing the next), and the step where that run ended.",
        "",
        HEADER,
        "|" + "---|" * COLUMNS,
    ]
    for (policy, group, eta), results in grid.items():
        row = table_row(policy, group, eta, args.batch_size, summarize(results), stalls(results))
        lines.append(row)
    lines += comparison(grid, args.batch_size)
    return "\n".join(lines) + "\n"


def plot(grid: Grid, args: argparse.Namespace, path: Path) -> None:
    """The share trained against η per group size and policy, and one η's backlog over the
    steps per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, backlog) = plt.subplots(1, 2, figsize=(13, 4.8))
    policies = list(dict.fromkeys(p for p, _, _ in grid))
    styles = ["--", "-", ":", "-."]
    for p, policy in enumerate(policies):
        for g, group in enumerate(args.groups):
            etas = [e for e in args.etas if (policy, group, e) in grid]
            values = [100 * summarize(grid[(policy, group, e)])["trained_share"][0] for e in etas]
            share.plot(
                etas,
                values,
                marker="o",
                ls=styles[p % len(styles)],
                color=f"C{g}",
                label=f"{policy}, group {group}",
            )
    share.set_xscale("symlog", linthresh=1)
    share.set_xticks(args.etas, [str(e) for e in args.etas])
    share.set(xlabel="max staleness η", ylabel="sampled tokens trained (%)", ylim=(0, 105))
    share.set_title("Share of judged tokens trained")
    share.legend(fontsize=8)
    eta = 4 if 4 in args.etas else args.etas[len(args.etas) // 2]
    group = 4 if 4 in args.groups else args.groups[0]
    for p, policy in enumerate(policies):
        key = (policy, group, eta)
        if key in grid:
            series = grid[key][0].backlog
            backlog.plot(
                [s for _, s, _ in series],
                [b for _, _, b in series],
                ls=styles[p % len(styles)],
                label=policy,
            )
    backlog.axhline((eta + 1) * args.batch_size, color="grey", ls="--", label="(η+1)·B")
    backlog.set_yscale("log")
    backlog.set(xlabel="step", ylabel="places held (places) / admitted, untrained (current)")
    backlog.set_title(f"Admission backlog, group {group}, η = {eta} (seed 0)")
    backlog.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
