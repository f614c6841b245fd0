"""Claim (b) under forced staleness: each step trains on a batch sampled by weights exactly eta
versions old, with decoupled and with plain PPO (issue 28 part 3).

The paper (AReaL, arXiv 2505.24298) claims that without its decoupled objective quality
degrades as the staleness bound eta grows, while decoupled PPO keeps it. The live ablation
(``bench/staleness_ablation.py``) cannot test that: on two shared cores the staleness it
achieves is 0.6-3.5 whatever eta. Here staleness is forced instead of hoped for: the replay
keeps a ring of the last 17 weight snapshots (state dicts copied to CPU after every step) and
step t trains on a batch sampled by snapshot ``max(0, t - eta)`` (version v is the weights
after v steps), so every trained token is exactly ``min(t, eta)`` versions old.

Everything but the timing is the real thing:

- the model is proxrl's tiny model (``server/common/tiny_model.py``: its real tokenizer and
  chat template) after the demo's cached supervised warm-up (``examples/agents/warm_start.py``,
  seed 0; every seed of the grid starts from it);
- training goes through the real backend and update: ``trainer.worker.Worker`` (FSDP2, world
  size 1, gloo, in this process) and its ``train_step`` (``trainer/algorithm.py``), with
  ``algorithm.decoupled`` true or false and every other option at its default (clip 0.2,
  behaviour cap 5 in token_mask mode, token-mean aggregation, ``--minibatches`` PPO minibatches
  per step);
- the task is the demo's: plain additions ``a+b=`` (a, b in 0..9), reward 1/0 on the final
  answer (``examples/agents/arithmetic.py``); ``--prompts`` problems a step from a seeded
  stream without the held-out ones, ``--group`` samples each at temperature 1, GRPO advantages
  (reward minus the group's mean, over its population std; a group whose rewards are all equal
  gets 0).

Sampling is a plain float32 Hugging Face forward with a KV cache (a seeded generator per seed
and step, so all cells of a seed sample step 0 identically). The behaviour logprob of each
sampled token is the snapshot's own logprob of it, computed by the trainer's packed forward
(``trainer.model.load_model``, ``trainer.batching``) on the snapshot's weights: the engine's
role, with no engine-vs-trainer mismatch to blur the staleness. At eta 0 it equals the
proximal logprob the step recomputes (``tests/unit/test_staleness_replay.py``).

Per step the replay records: the drift ``KL(pi_t || pi_{t-1})`` between consecutive versions,
exact over the whole vocabulary at each answer token of a fixed probe set (the ``--heldout``
"seen" problems of ``heldout.evaluation_sets`` with their correct completions), averaged over
those tokens; the clipped share and, with decoupled PPO, the behaviour-masked share of the loss
tokens (the worker's own counts); the batch's mean reward. Every ``--eval-every`` steps, and at
the start and the end: held-out accuracy over the ``--heldout`` held-out problems (which
training never draws), at temperature 1 (``--eval-samples`` samples each, a fixed generator:
every cell is scored on the same random numbers) and greedily.

At eta 0 decoupled and plain PPO compute the same update (the proximal policy is the behaviour
policy), so eta 0 runs once per seed (plain) and is the baseline of both columns.

Results: ``--out`` (JSON, rewritten after every run, so a partial grid is readable) and a
markdown table and plot in ``--results-dir``. ``--report-only`` rebuilds those from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import multiprocessing
import random
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import arithmetic  # noqa: E402  (examples/agents, on the path above)
import heldout  # noqa: E402

from bench.common import positive_int  # noqa: E402

RING = 17  # snapshots kept: versions t - 16 .. t, enough for eta <= 16
MODES = ("decoupled", "plain")
DEFAULT_ETAS = (0, 1, 2, 4, 8, 16)
EVAL_SEED = 7_000_003  # the held-out evaluation's generator: the same numbers in every cell


# ----- the task ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    problem: arithmetic.Problem
    ids: list[int]  # the chat-templated prompt, generation prompt included


class Task:
    """The plain additions, tokenized once: the held-out set, the probe set and the stream."""

    def __init__(self, model_dir: Path, heldout_size: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = int(self.tokenizer.eos_token_id)
        sets = heldout.evaluation_sets(heldout_size)
        self.heldout = [self.prompt(p) for p in sets[heldout.HELDOUT]]
        self.probe = [self.prompt(p) for p in sets[heldout.SEEN]]
        # the probe rows: prompt + correct completion + end of turn; loss = completion tokens
        self.probe_rows = [
            (p.ids, [*self.encode(arithmetic.solution(p.problem)), self.eos]) for p in self.probe
        ]

    def prompt(self, problem: arithmetic.Problem) -> Prompt:
        ids = self.tokenizer.apply_chat_template(
            arithmetic.messages(problem), add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return Prompt(problem, list(ids))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def stream(self, seed: int) -> Any:
        problems = heldout.training_problems(
            arithmetic.problems(seed), [p.problem for p in self.heldout]
        )
        return (self.prompt(problem) for problem in problems)

    def reward(self, prompt: Prompt, completion: Sequence[int]) -> float:
        tokens = [t for t in completion if t != self.eos]
        return arithmetic.reward(prompt.problem, self.tokenizer.decode(tokens))


# ----- models outside the worker ----------------------------------------------------------------


class Snapshot:
    """Plain (unsharded) copies of the model that load a snapshot's weights: ``sampler`` decodes
    with a KV cache, ``scorer`` is the trainer's packed forward (behaviour logprobs)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        from trainer.model import load_model

        self.sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.scorer = load_model(model_dir).eval()
        self.version = -1

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if version == self.version:
            return
        for model in (self.sampler, self.scorer):
            missing, unexpected = model.load_state_dict(state, strict=False)
            # the tied output embedding is published once, under the input embedding's name
            if unexpected or any(not name.startswith("lm_head") for name in missing):
                raise RuntimeError(f"snapshot does not fit: {missing=} {unexpected=}")
            model.tie_weights()
        self.version = version

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[list[int]],
        eos: int,
        max_new: int,
        generator: torch.Generator | None,
    ) -> list[list[int]]:
        """One completion per prompt at temperature 1 (greedy when ``generator`` is None), cut
        after the end-of-turn token or ``max_new`` tokens."""
        out: list[list[int]] = [[] for _ in prompts]
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(i)
        for indices in by_length.values():
            ids = torch.tensor([prompts[i] for i in indices])
            result = self.sampler(input_ids=ids, use_cache=True)
            past, logits = kv_cache(result), result.logits[:, -1].float()
            done = [False] * len(indices)
            for _ in range(max_new):
                if generator is None:
                    tokens = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits, -1)
                    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
                for row, token in enumerate(tokens.tolist()):
                    if not done[row]:
                        out[indices[row]].append(token)
                        done[row] = token == eos
                if all(done):
                    break
                result = self.sampler(input_ids=tokens[:, None], use_cache=True, **{CACHE: past})
                past, logits = kv_cache(result), result.logits[:, -1].float()
        return out

    @torch.no_grad()
    def logprobs(self, rows: Sequence[list[int]]) -> list[list[float]]:
        """The packed forward the worker runs (temperature 1): each token's logprob given the
        tokens before it in its row, 0 at each row's first token."""
        from trainer.batching import packed, shift_logprobs

        batch = packed(list(rows))
        logits = self.scorer(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            cu_seq_lens_q=batch.cu_seqlens,
            use_cache=False,
        ).logits[0]
        values = shift_logprobs(logits.float(), batch.input_ids[0], batch.cu_seqlens).tolist()
        split, start = [], 0
        for row in rows:
            split.append(values[start : start + len(row)])
            start += len(row)
        return split

    @torch.no_grad()
    def answer_distributions(self, rows: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
        """Log-softmax over the vocabulary at each answer token of each (prompt, answer) row,
        stacked: [answer tokens, vocabulary]."""
        out = []
        for prompt, answer in rows:
            ids = torch.tensor([prompt + answer])
            logits = self.sampler(input_ids=ids, use_cache=False).logits[0].float()
            out.append(torch.log_softmax(logits[len(prompt) - 1 : -1], -1))
        return torch.cat(out)


# transformers renamed the KV cache argument and output from past_key_values to cache (5.2x)
CACHE = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


def kv_cache(result: Any) -> Any:
    return result[CACHE]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) = sum_v p(v) (log p(v) - log q(v)), in float64."""
    log_p, log_q = log_p.double(), log_q.double()
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def grpo_advantages(rewards: Sequence[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if std == 0:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


# ----- one run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    eta: int
    mode: str  # "decoupled" | "plain"
    seed: int
    steps: int
    lr: float
    prompts: int = 8
    group: int = 8
    minibatches: int = 4
    max_new: int = 12
    eval_every: int = 5
    eval_samples: int = 16
    threads: int = 1


@dataclass
class Batch:
    version: int  # the snapshot that sampled it
    samples: list[Any]  # trainer.rollouts.Sample
    rewards: list[float]


@dataclass
class RunResult:
    config: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


class Replay:
    """One forced-staleness run: a worker, a ring of its snapshots, and the task."""

    def __init__(self, model_dir: Path, task: Task, config: RunConfig) -> None:
        from trainer.config import AlgorithmConfig, OptimConfig
        from trainer.worker import Worker, WorkerSettings

        if not 0 <= config.eta < RING:
            raise ValueError(f"eta must be in 0..{RING - 1}, not {config.eta}")
        if config.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {config.mode!r}")
        self.config, self.task = config, task
        algorithm = AlgorithmConfig(temperature=1.0, decoupled=config.mode == "decoupled")
        settings = WorkerSettings(
            model_dir=str(model_dir),
            lr=config.lr,
            optim=OptimConfig(),
            algorithm=algorithm,
            seed=config.seed,
            device="cpu",
            threads=config.threads,
        )
        self.worker = Worker(0, 1, settings)
        self.worker.setup("127.0.0.1", free_port())  # world size 1: a rendezvous of one
        self.models = Snapshot(model_dir)
        self.version = 0
        self.ring: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=RING)
        self.ring.append((0, self.snapshot()))
        self.stream = task.stream(config.seed)
        self.probe_before = self.probe(0)

    def close(self) -> None:
        self.worker.shutdown()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The worker's weights now, copied (the published state may share the parameters'
        storage on CPU, and the optimizer updates those in place)."""
        return {name: t.detach().clone() for name, t in self.worker.published_state().items()}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        for held, state in self.ring:
            if held == version:
                return state
        raise KeyError(f"version {version} left the ring (holds {[v for v, _ in self.ring]})")

    def source_version(self, step: int) -> int:
        """The snapshot that samples step ``step``'s batch: eta versions old, 0 before that."""
        return max(0, step - self.config.eta)

    def sample_batch(self, step: int) -> Batch:
        from trainer.rollouts import Sample

        config = self.config
        source = self.source_version(step)
        self.models.load(source, self.weights(source))
        prompts = [next(self.stream) for _ in range(config.prompts)]
        rows = [p for p in prompts for _ in range(config.group)]
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        completions = self.models.sample(
            [p.ids for p in rows], self.task.eos, config.max_new, generator
        )
        sequences = [p.ids + c for p, c in zip(rows, completions, strict=True)]
        behaviour = self.models.logprobs(sequences)
        rewards = [self.task.reward(p, c) for p, c in zip(rows, completions, strict=True)]
        advantages: list[float] = []
        for g in range(config.prompts):
            advantages += grpo_advantages(rewards[g * config.group : (g + 1) * config.group])
        samples = []
        for i, (prompt, completion) in enumerate(zip(rows, completions, strict=True)):
            n, m = len(prompt.ids), len(completion)
            samples.append(
                Sample(
                    session_id=f"s{step}-{i}",
                    input_ids=sequences[i],
                    loss_mask=[0] * n + [1] * m,
                    behaviour=[0.0] * n + behaviour[i][n:],
                    versions=[-1] * n + [source] * m,
                    advantages=[0.0] * n + [advantages[i]] * m,
                    fresh=[0] * n + [int(source == self.version)] * m,
                )
            )
        return Batch(source, samples, rewards)

    def train(self, batch: Batch) -> dict[str, Any]:
        from trainer.plan import plan_step

        plan = plan_step(batch.samples, 1, minibatch_count=self.config.minibatches, max_tokens=4096)
        stats = self.worker.train_step(plan.per_rank[0], plan.tokens, plan.sequences)
        self.version += 1
        self.ring.append((self.version, self.snapshot()))
        return stats

    def probe(self, version: int) -> torch.Tensor:
        self.models.load(version, self.weights(version))
        return self.models.answer_distributions(self.task.probe_rows)

    def step(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        batch = self.sample_batch(step)
        sampled = time.perf_counter()
        stats = self.train(batch)
        trained = time.perf_counter()
        after = self.probe(self.version)
        drift = kl(after, self.probe_before)
        self.probe_before = after
        tokens = max(stats["tokens"], 1.0)
        return {
            "step": step,
            "source_version": batch.version,
            "staleness": self.version - 1 - batch.version,
            "reward_mean": statistics.fmean(batch.rewards),
            "drift_kl": drift,
            "clipped_share": stats["clipped_tokens"] / tokens,
            "behaviour_masked_share": stats["behaviour_masked_tokens"] / tokens,
            "behaviour_over_cap_share": stats["behaviour_over_cap_tokens"] / tokens,
            "mismatch": stats["mismatch_sum"] / max(stats["mismatch_tokens"], 1.0),
            "tokens": stats["tokens"],
            "seconds": time.perf_counter() - started,
            "sample_seconds": sampled - started,
            "train_seconds": trained - sampled,
        }

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out accuracy of the current version: mean reward at temperature 1 over
        ``eval_samples`` samples of each held-out problem, and greedy."""
        self.models.load(self.version, self.weights(self.version))
        held = self.task.heldout
        rows = [p for p in held for _ in range(self.config.eval_samples)]
        generator = torch.Generator().manual_seed(EVAL_SEED)
        sampled = self.models.sample([p.ids for p in rows], self.task.eos, 12, generator)
        greedy = self.models.sample([p.ids for p in held], self.task.eos, 12, None)
        return {
            "step": step,
            "version": self.version,
            "heldout_t1": statistics.fmean(
                self.task.reward(p, c) for p, c in zip(rows, sampled, strict=True)
            ),
            "heldout_greedy": statistics.fmean(
                self.task.reward(p, c) for p, c in zip(held, greedy, strict=True)
            ),
        }


def run_one(model_dir: Path, heldout_size: int, config: RunConfig) -> dict[str, Any]:
    """``run`` in a fresh process (the pool's): the result as a dict."""
    return asdict(run(model_dir, Task(model_dir, heldout_size), config))


def progress_line(result: dict[str, Any], index: int, total: int, elapsed: float) -> str:
    c, first, last = result["config"], result["evals"][0], result["evals"][-1]
    drift = statistics.fmean(s["drift_kl"] for s in result["steps"])
    left = elapsed / index * (total - index)
    return (
        f"[{index}/{total}] lr {c['lr']:g} eta {c['eta']:2d} {c['mode']:9s} seed {c['seed']}: "
        f"held-out T=1 {first['heldout_t1']:.3f} -> {last['heldout_t1']:.3f}, greedy "
        f"{first['heldout_greedy']:.2f} -> {last['heldout_greedy']:.2f}, drift {drift:.2e}/step;"
        f" {c['steps'] / result['seconds']:.2f} steps/s, {result['seconds']:.0f} s; "
        f"ETA {left / 60:.1f} min"
    )


def run(model_dir: Path, task: Task, config: RunConfig) -> RunResult:
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    started = time.perf_counter()
    replay = Replay(model_dir, task, config)
    result = RunResult(config=asdict(config))
    try:
        result.evals.append(replay.evaluate(0))
        for step in range(config.steps):
            result.steps.append(replay.step(step))
            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                result.evals.append(replay.evaluate(done))
    finally:
        replay.close()
    result.seconds = time.perf_counter() - started
    return result


# ----- the grid and its report ------------------------------------------------------------------


def cells(etas: Sequence[int], modes: Sequence[str], seeds: int) -> list[tuple[int, str, int]]:
    """(eta, mode, seed) for every run, seed-major so a cut-short grid has whole seeds; eta 0
    once per seed (plain: both objectives compute the same update there)."""
    out = []
    for seed in range(seeds):
        for eta in etas:
            for mode in modes:
                if eta == 0 and mode != "plain" and "plain" in modes:
                    continue
                out.append((eta, mode, seed))
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: Sequence[float], digits: int = 3) -> str:
    mean, std = mean_std(values)
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def summarise(runs: Sequence[dict[str, Any]], final_steps: int) -> dict[str, Any]:
    """Per (eta, mode) cell, over seeds: final held-out accuracy (temperature 1 and greedy), its
    change from the start, mean per-step drift, clipped and behaviour-masked shares, and the
    training reward of the last ``final_steps`` steps."""
    by_cell: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        c = r["config"]
        by_cell.setdefault((c["eta"], c["mode"]), []).append(r)
    out = {}
    for (eta, mode), group in sorted(by_cell.items()):

        def per_run(f: Any, group: list[dict[str, Any]] = group) -> list[float]:
            return [f(r) for r in group]

        out[f"{eta}/{mode}"] = {
            "eta": eta,
            "mode": mode,
            "seeds": len(group),
            "heldout_t1": per_run(lambda r: r["evals"][-1]["heldout_t1"]),
            "heldout_t1_start": per_run(lambda r: r["evals"][0]["heldout_t1"]),
            "heldout_greedy": per_run(lambda r: r["evals"][-1]["heldout_greedy"]),
            "gain_t1": per_run(
                lambda r: r["evals"][-1]["heldout_t1"] - r["evals"][0]["heldout_t1"]
            ),
            "drift_kl": per_run(lambda r: statistics.fmean(s["drift_kl"] for s in r["steps"])),
            "clipped_share": per_run(
                lambda r: statistics.fmean(s["clipped_share"] for s in r["steps"])
            ),
            "behaviour_masked_share": per_run(
                lambda r: statistics.fmean(s["behaviour_masked_share"] for s in r["steps"])
            ),
            "final_reward": per_run(
                lambda r: statistics.fmean(s["reward_mean"] for s in r["steps"][-final_steps:])
            ),
            "seconds": per_run(lambda r: r["seconds"]),
        }
    return out


def report(data: dict[str, Any], results_dir: Path, name: str = "staleness-replay") -> Path:
    summary = data["summary"]
    settings = data["settings"]
    lines = [
        "# Forced-staleness replay (claim (b))",
        "",
        f"`bench/staleness_replay.py`, measured {data['date']} on {settings['machine']}. "
        f"Tiny model after the demo's warm-up, plain additions, {settings['prompts']} problems "
        f"x {settings['group']} samples a step, {settings['minibatches']} PPO minibatches, "
        f"lr {settings['lr']}, {settings['steps']} steps, {settings['heldout']} held-out problems "
        f"x {settings['eval_samples']} samples at temperature 1. Mean ± std over seeds.",
        "",
        "| eta | objective | seeds | held-out (T=1) | change from start | held-out (greedy) "
        "| batch reward, last steps (the stale sampler's) | drift KL / step | clipped share "
        "| behaviour-masked share |",
        "|---:|---|---:|---|---|---|---|---|---|---|",
    ]
    for cell in summary.values():
        lines.append(
            f"| {cell['eta']} | {cell['mode'] if cell['eta'] else 'either (same update)'} "
            f"| {cell['seeds']} | {fmt(cell['heldout_t1'])} | {fmt(cell['gain_t1'])} "
            f"| {fmt(cell['heldout_greedy'])} | {fmt(cell['final_reward'])} "
            f"| {fmt(cell['drift_kl'], 5)} | {fmt(cell['clipped_share'])} "
            f"| {fmt(cell['behaviour_masked_share'])} |"
        )
    lines += ["", pilot_verdict(summary) + ".", ""]
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    plot(summary, results_dir / f"{name}.png")
    return path


def plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    base = summary.get("0/plain")
    for mode, colour in (("decoupled", "tab:blue"), ("plain", "tab:red")):
        chosen = [c for c in summary.values() if c["mode"] == mode and c["eta"] > 0]
        if base is not None:
            chosen = [base, *chosen]
        if not chosen:
            continue
        etas = [c["eta"] for c in chosen]
        for axis, key in ((left, "heldout_t1"), (right, "drift_kl")):
            means = [mean_std(c[key])[0] for c in chosen]
            stds = [mean_std(c[key])[1] for c in chosen]
            axis.errorbar(etas, means, yerr=stds, label=f"{mode} PPO", color=colour, capsize=3)
    left.set(xlabel="staleness eta (versions)", ylabel="final held-out accuracy (T=1)")
    right.set(xlabel="staleness eta (versions)", ylabel="mean KL(pi_t || pi_t-1) per step")
    for axis in (left, right):
        axis.set_xscale("symlog", linthresh=1)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(
    out: Path, settings: dict[str, Any], runs: list[dict[str, Any]], final_steps: int
) -> dict:
    data = {
        "date": datetime.date.today().isoformat(),
        "settings": settings,
        "summary": summarise(runs, final_steps),
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, separators=(",", ":")))
    return data


def pilot_verdict(summary: dict[str, Any]) -> str:
    cell = summary.get("0/plain")
    if cell is None or cell["seeds"] < 2:
        return "pilot: needs eta 0 (plain) over at least 2 seeds"
    mean, std = mean_std(cell["gain_t1"])
    z = mean / std if std > 0 else math.inf
    verdict = "clearly improves" if z > 3 else "does NOT clearly improve"
    return (
        f"pilot: synchronous training {verdict} held-out accuracy (T=1): "
        f"{fmt(cell['heldout_t1_start'])} -> {fmt(cell['heldout_t1'])}, "
        f"gain {mean:+.3f} ± {std:.3f} over {cell['seeds']} seeds ({z:.1f} std)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=positive_int, default=5)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument(
        "--etas", default=",".join(map(str, DEFAULT_ETAS)), help="comma-separated, each 0..16"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="decoupled,plain (or one)")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--prompts", type=positive_int, default=8, help="problems per step")
    parser.add_argument("--group", type=positive_int, default=8, help="samples per problem")
    parser.add_argument("--minibatches", type=positive_int, default=4, help="PPO minibatches")
    parser.add_argument("--eval-every", type=positive_int, default=10)
    parser.add_argument("--eval-samples", type=positive_int, default=16)
    parser.add_argument("--heldout", type=positive_int, default=20, help="held-out problems")
    parser.add_argument("--final-steps", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per run")
    parser.add_argument(
        "--machine", default="a 2-core CPU machine shared with other work", help="for the report"
    )
    parser.add_argument("--jobs", type=positive_int, default=1, help="runs at once (processes)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/staleness_replay.json")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "docs/bench-results")
    parser.add_argument(
        "--model-dir", type=Path, help="the starting model (default: the demo's warm-up, cached)"
    )
    parser.add_argument("--name", default="staleness-replay", help="the report's file name")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only")
    parser.add_argument("--resume", action="store_true", help="keep --out's runs, add the rest")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report")
    args = parser.parse_args(argv)
    args.etas = [int(e) for e in args.etas.split(",")]
    args.modes = args.modes.split(",")
    if any(not 0 <= eta < RING for eta in args.etas):
        parser.error(f"--etas: each must be in 0..{RING - 1}")
    if any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes: each must be one of {MODES}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report_only:
        data = json.loads(args.out.read_text())
        print(report(data, args.results_dir, args.name))
        print(pilot_verdict(data["summary"]))
        return
    sys.path.insert(0, str(ROOT / "examples" / "agents"))
    from warm_start import CACHE_DIR, warm_model

    model_dir = args.model_dir or warm_model(CACHE_DIR, seed=0, progress=False)
    settings = {
        key: getattr(args, key)
        for key in (
            *("seeds", "steps", "etas", "modes", "lr", "prompts", "group", "minibatches"),
            *("eval_every", "eval_samples", "heldout", "final_steps", "threads", "jobs", "machine"),
        )
    }
    todo = cells(args.etas, args.modes, args.seeds)
    configs = [
        RunConfig(
            eta=eta,
            mode=mode,
            seed=seed,
            steps=args.steps,
            lr=args.lr,
            prompts=args.prompts,
            group=args.group,
            minibatches=args.minibatches,
            eval_every=args.eval_every,
            eval_samples=args.eval_samples,
            threads=args.threads,
        )
        for eta, mode, seed in todo
    ]
    runs: list[dict[str, Any]] = []
    if args.resume and args.out.exists():  # keep the runs there, run only the missing cells
        previous = json.loads(args.out.read_text())
        runs = previous["runs"]
        for r in runs:
            r.setdefault("machine", previous["settings"]["machine"])
        settings["machine"] = "; ".join(sorted({r["machine"] for r in runs} | {args.machine}))
        done = {json.dumps(r["config"], sort_keys=True) for r in runs}
        configs = [c for c in configs if json.dumps(asdict(c), sort_keys=True) not in done]
        print(f"resuming: {len(runs)} runs kept, {len(configs)} to run", flush=True)
    started = time.perf_counter()
    data = write(args.out, settings, runs, args.final_steps)
    context = multiprocessing.get_context("spawn")  # each run its own process group
    with ProcessPoolExecutor(args.jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = [pool.submit(run_one, model_dir, args.heldout, c) for c in configs]
        for index, future in enumerate(as_completed(futures), 1):
            result = future.result()
            result["machine"] = args.machine
            runs.append(result)
            data = write(args.out, settings, runs, args.final_steps)
            elapsed = time.perf_counter() - started
            print(progress_line(result, index, len(configs), elapsed), flush=True)
    if not args.no_report:
        print(report(data, args.results_dir, args.name))
    print(pilot_verdict(data["summary"]))


if __name__ == "__main__":
    main()
