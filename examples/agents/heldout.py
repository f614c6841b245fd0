"""A held-out evaluation for the arithmetic task: a fixed set of problems the agent never
trains on, answered greedily in evaluation sessions and scored by the policy version that
answered.

The plain task has only 100 problems (``a+b`` with ``a, b`` in 0..9), so a training stream
visits every one of them within a few hundred sessions: a held-out set drawn from another seed
would still be trained on. Here the set is disjoint by content instead. ``heldout_set`` takes
the first ``size`` distinct problems of its own seeded stream, and ``training_problems`` drops
those from the training stream. (The supervised warm-up still sees them: the tiny model cannot
add pairs it was never shown, so the question the set asks is whether reinforcement learning on
the other problems carries over to these.)

Each problem is one session created with ``eval=True`` and task_id ``"heldout"``: the server
serves and records it but never trains on it nor counts it against admission, and charts its
reward per policy version in ``GET /rl/runs/{id}`` (its ``eval`` list). An answer counts under
the policy version of its first completion token, the rule the server uses, so the figures here
and the server's can be compared exactly (``disagreements``).

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
    "HELDOUT_SEED",
    "TASK_ID",
    "Answer",
    "by_version",
    "disagreements",
    "evaluate",
    "heldout_set",
    "server_by_version",
    "training_problems",
]

# Its own stream: random.Random(HELDOUT_SEED), far from the small seeds the demo trains on.
HELDOUT_SEED = 2_017_017
TASK_ID = "heldout"
REQUEST_TIMEOUT_S = 300.0
MAX_RETRIES = 1000  # 5xx and 429 only wait (eval sessions are never held back by admission)


@dataclass(frozen=True)
class Answer:
    problem: arithmetic.Problem
    text: str
    reward: float  # 1.0 for the exact answer, else 0.0
    version: int  # the policy version of the first completion token: the weights that answered


def heldout_set(size: int, seed: int = HELDOUT_SEED) -> list[arithmetic.Problem]:
    """The first ``size`` distinct problems of ``arithmetic.problems(seed)`` (plain problems;
    at most 100 exist)."""
    if not 0 < size <= 100:
        raise ValueError(f"a held-out set holds 1 to 100 plain problems, not {size}")
    chosen: dict[str, arithmetic.Problem] = {}
    for problem in arithmetic.problems(seed):
        chosen.setdefault(problem.task_id, problem)
        if len(chosen) == size:
            return list(chosen.values())
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
    problems: list[arithmetic.Problem],
    *,
    max_tokens: int = 16,
) -> list[Answer]:
    """Every problem at once, each in its own evaluation session at temperature 0 (greedy):
    asked, its version read back, rewarded 1/0, ended. Asked together, the answers mostly come
    from one policy version; when the weights change mid-way, some come from the next."""
    return list(
        await asyncio.gather(
            *(answer(client, http, model, run_id, problem, max_tokens) for problem in problems)
        )
    )


async def answer(
    client: AsyncClient,
    http: httpx.AsyncClient,
    model: str,
    run_id: str,
    problem: arithmetic.Problem,
    max_tokens: int,
) -> Answer:
    session = await client.session(run_id=run_id, task_id=TASK_ID, eval=True)
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
    return Answer(problem, text, reward, version)


def by_version(answers: Iterable[Answer]) -> list[dict[str, Any]]:
    """Accuracy per answering version: [{version, count, mean}], by version."""
    rewards: dict[int, list[float]] = {}
    for item in answers:
        rewards.setdefault(item.version, []).append(item.reward)
    return [
        {"version": version, "count": len(values), "mean": statistics.fmean(values)}
        for version, values in sorted(rewards.items())
    ]


def server_by_version(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The held-out task's rows of ``GET /rl/runs/{id}``'s ``eval`` figures (its per version
    and task list), as ``by_version`` gives them."""
    tasks = run.get("eval", {}).get("tasks", [])
    rows = [row for row in tasks if row["task_id"] == TASK_ID]
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
