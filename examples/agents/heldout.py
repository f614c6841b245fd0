"""A held-out evaluation for the arithmetic task: a fixed set of problems the agent never
trains on, and beside it a fixed set it does train on, both answered greedily in evaluation
sessions and scored by the policy version that answered.

The plain task has only 100 problems (``a+b`` with ``a, b`` in 0..9), so a training stream
visits every one of them within a few hundred sessions: a held-out set drawn from another seed
would still be trained on. Here the set is disjoint by content instead. ``evaluation_sets``
takes the first ``size`` distinct problems of its own seeded stream as the held-out set (task
``"heldout"``) and the next ``size`` distinct ones as the seen set (task ``"seen"``);
``training_problems`` drops the held-out ones from the training stream. (The supervised warm-up
still sees every problem: the tiny model cannot add pairs it was never shown.) The two answer
different questions: the held-out set whether what reinforcement learning teaches on some
problems carries over to others, the seen set whether the policy's greedy answers improve at
all on what it practises.

Each problem is one session created with ``eval=True`` and its set's task_id: the server serves
and records it but never trains on it nor counts it against admission, and charts its reward
per policy version and task in ``GET /rl/runs/{id}`` (its ``eval`` figures). An answer counts
under the policy version of its first completion token, the rule the server uses, so the
figures here and the server's can be compared exactly (``disagreements``).

Knows the proxy only through ``client_sdk`` and the openai SDK.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import arithmetic
import httpx

from client_sdk import AsyncClient

__all__ = [
    "EVAL_SEED",
    "HELDOUT",
    "SEEN",
    "Answer",
    "by_version",
    "disagreements",
    "evaluate",
    "evaluation_sets",
    "server_by_version",
    "training_problems",
]

# Its own stream: random.Random(EVAL_SEED), far from the small seeds the demo trains on.
EVAL_SEED = 2_017_017
HELDOUT, SEEN = "heldout", "seen"  # the sets' task ids
PLAIN_PROBLEMS = 100
REQUEST_TIMEOUT_S = 300.0
MAX_RETRIES = 1000  # 5xx and 429 only wait (eval sessions are never held back by admission)


@dataclass(frozen=True)
class Answer:
    task_id: str  # the set: HELDOUT or SEEN
    problem: arithmetic.Problem
    text: str
    reward: float  # 1.0 for the exact answer, else 0.0
    version: int  # the policy version of the first completion token: the weights that answered


def evaluation_sets(size: int, seed: int = EVAL_SEED) -> dict[str, list[arithmetic.Problem]]:
    """``{HELDOUT: ..., SEEN: ...}``: the first ``size`` distinct problems of
    ``arithmetic.problems(seed)``, then the next ``size`` (plain problems; 100 exist)."""
    if not 0 < size <= PLAIN_PROBLEMS // 2:
        raise ValueError(f"each set holds 1 to {PLAIN_PROBLEMS // 2} problems, not {size}")
    chosen: dict[str, arithmetic.Problem] = {}
    for problem in arithmetic.problems(seed):
        chosen.setdefault(problem.task_id, problem)
        if len(chosen) == 2 * size:
            drawn = list(chosen.values())
            return {HELDOUT: drawn[:size], SEEN: drawn[size:]}
    raise AssertionError("unreachable: the stream is endless")


def training_problems(
    stream: Iterator[arithmetic.Problem], heldout: Iterable[arithmetic.Problem]
) -> Iterator[arithmetic.Problem]:
    """``stream`` without the held-out problems."""
    held = {problem.task_id for problem in heldout}
    return (problem for problem in stream if problem.task_id not in held)


async def evaluate(
    client: AsyncClient,
    http: httpx.AsyncClient,
    model: str,
    run_id: str,
    sets: Mapping[str, list[arithmetic.Problem]],
    *,
    max_tokens: int = 16,
) -> list[Answer]:
    """Every problem of every set at once, each in its own evaluation session at temperature 0
    (greedy): asked, its version read back, rewarded 1/0, ended. Asked together, the answers
    mostly come from one policy version; when the weights change mid-way, some come from the
    next."""
    asked = [(task, problem) for task, problems in sets.items() for problem in problems]
    return list(
        await asyncio.gather(
            *(answer(client, http, model, run_id, t, p, max_tokens) for t, p in asked)
        )
    )


async def answer(
    client: AsyncClient,
    http: httpx.AsyncClient,
    model: str,
    run_id: str,
    task_id: str,
    problem: arithmetic.Problem,
    max_tokens: int,
) -> Answer:
    session = await client.session(run_id=run_id, task_id=task_id, eval=True)
    chat = session.async_openai(
        http_client=http, max_retries=MAX_RETRIES, timeout=REQUEST_TIMEOUT_S
    )
    reply = await chat.chat.completions.create(
        model=model,
        messages=arithmetic.messages(problem),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0.0,
    )
    text = reply.choices[0].message.content or ""
    # Read before the reward is posted: an answer the server counts is always one we know.
    version = (await session.get())["turns"][0]["versions"][0]
    reward = arithmetic.reward(problem, text)
    await session.reward(reward)
    await session.end()
    return Answer(task_id, problem, text, reward, version)


def by_version(answers: Iterable[Answer], task_id: str) -> list[dict[str, Any]]:
    """One set's accuracy per answering version: [{version, count, mean}], by version."""
    rewards: dict[int, list[float]] = {}
    for item in answers:
        if item.task_id == task_id:
            rewards.setdefault(item.version, []).append(item.reward)
    return [
        {"version": version, "count": len(values), "mean": statistics.fmean(values)}
        for version, values in sorted(rewards.items())
    ]


def server_by_version(run: Mapping[str, Any], task_id: str) -> list[dict[str, Any]]:
    """One set's rows of ``GET /rl/runs/{id}``'s ``eval`` figures (its per version and task
    list), as ``by_version`` gives them."""
    tasks = run.get("eval", {}).get("tasks", [])
    rows = [row for row in tasks if row["task_id"] == task_id]
    return [
        {"version": row["version"], "count": row["count"], "mean": row["mean"]}
        for row in sorted(rows, key=lambda row: row["version"])
    ]


def disagreements(
    ours: list[dict[str, Any]], theirs: list[dict[str, Any]], tolerance: float = 1e-9
) -> list[str]:
    """Where two per-version lists differ (versions, counts, or means beyond ``tolerance``)."""
    mine = {row["version"]: row for row in ours}
    server = {row["version"]: row for row in theirs}
    problems = []
    for version in sorted(mine.keys() | server.keys()):
        a, b = mine.get(version), server.get(version)
        if a is None or b is None:
            problems.append(f"version {version}: only {'the server' if a is None else 'the demo'}")
        elif a["count"] != b["count"] or abs(a["mean"] - b["mean"]) > tolerance:
            problems.append(
                f"version {version}: demo {a['count']} answers, mean {a['mean']:.6f}; "
                f"server {b['count']}, mean {b['mean']:.6f}"
            )
    return problems
