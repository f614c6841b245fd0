"""A single-turn math agent in GRPO groups, trained through proxrl.

Each problem comes from ``arithmetic.py`` (generated from a seed, nothing downloaded). The
agent opens ``--group-size`` sessions for it under one ``group_id`` (a GRPO group: the trainer
compares the group's answers with each other), asks the question once in each through a stock
``openai.AsyncOpenAI`` pointed at the session, posts reward 1.0 for the exact answer (else
0.0), and ends the session. ``--concurrency`` sessions are in flight at once.

A group's sessions are created together and groups one after another, so the server's
admission (AReaL's staleness bound) never lets in part of a group: a half-admitted group could
never be claimed whole. Session creation waits in the server while admission is closed; 429s
and 5xx are retried with backoff by ``client_sdk``.

    python examples/agents/math_agent.py --base-url http://127.0.0.1:8000 --admin-key KEY \\
        --sessions 64 --group-size 8 --concurrency 16

The reusable pieces are ``MathAgent`` (runs until cancelled or a number of sessions, calling
``on_episode`` after each) and ``run_math_agent(client, sessions=...)``. The agent knows the
proxy only through ``client_sdk`` and the openai SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import arithmetic
import httpx

from client_sdk import AsyncClient, AsyncSession

__all__ = ["AgentLog", "Episode", "MathAgent", "run_math_agent"]

# Session creation may wait in the server for admission; requests time out well after that.
REQUEST_TIMEOUT_S = 300.0
MAX_RETRIES = 1000  # 429s (admission) and 5xx only wait: the agent never gives up on them


@dataclass(frozen=True)
class Episode:
    session_id: str
    group_id: str
    problem: arithmetic.Problem
    text: str  # the model's answer
    reward: float
    completion_tokens: int
    at: float  # time.monotonic() when the reward was posted


@dataclass
class AgentLog:
    """What the agent did: its episodes, and the time it had at least one session in flight."""

    episodes: list[Episode] = field(default_factory=list)
    busy_s: float = 0.0
    in_flight: int = 0
    _since: float = 0.0

    @property
    def rewards(self) -> list[float]:
        return [episode.reward for episode in self.episodes]

    @property
    def completion_tokens(self) -> list[int]:
        return [episode.completion_tokens for episode in self.episodes]

    def begin(self) -> None:
        if self.in_flight == 0:
            self._since = time.monotonic()
        self.in_flight += 1

    def finish(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.busy_s += time.monotonic() - self._since

    def close(self) -> None:
        """Count the interval still open when the agent is stopped."""
        if self.in_flight > 0:
            self.busy_s += time.monotonic() - self._since
            self.in_flight = 0


@dataclass
class MathAgent:
    client: AsyncClient
    http: httpx.AsyncClient  # shared by every session's AsyncOpenAI
    model: str
    run_id: str | None
    problems: Iterator[arithmetic.Problem]
    concurrency: int = 16
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    on_episode: Callable[[Episode], None] | None = None
    log: AgentLog = field(default_factory=AgentLog)

    async def run(self, limit: int | None = None) -> AgentLog:
        """Sessions until cancelled, or ``limit`` sessions (rounded up to whole groups)."""
        create = asyncio.Lock()  # groups are admitted whole, one after another
        groups = itertools.count()
        taken = 0

        async def worker() -> None:
            nonlocal taken
            while True:
                async with create:
                    if limit is not None and taken >= limit:
                        return
                    taken += self.group_size
                    problem, group = next(self.problems), f"g{next(groups)}-s{self.seed}"
                    sessions = [
                        self.client.session(
                            run_id=self.run_id, task_id=problem.task_id, group_id=group
                        )
                        for _ in range(self.group_size)
                    ]
                    await asyncio.gather(*(session.start() for session in sessions))
                first_seed = self.seed * 1_000_003 + taken
                await asyncio.gather(
                    *(
                        self.episode(session, group, problem, first_seed + i)
                        for i, session in enumerate(sessions)
                    )
                )

        workers = [asyncio.create_task(worker()) for _ in range(self.groups_in_flight)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.log.close()
        return self.log

    @property
    def groups_in_flight(self) -> int:
        return max(1, self.concurrency // self.group_size)

    async def episode(
        self, session: AsyncSession, group: str, problem: arithmetic.Problem, seed: int
    ) -> Episode:
        self.log.begin()
        try:
            model = session.async_openai(
                http_client=self.http, max_retries=MAX_RETRIES, timeout=REQUEST_TIMEOUT_S
            )
            reply = await model.chat.completions.create(
                model=self.model,
                messages=arithmetic.messages(problem),  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=seed,
            )
            text = reply.choices[0].message.content or ""
            reward = arithmetic.reward(problem, text)
            await session.reward(reward)
            await session.end()
        finally:
            self.log.finish()
        tokens = reply.usage.completion_tokens if reply.usage else 0
        episode = Episode(session.id, group, problem, text, reward, tokens, time.monotonic())
        self.log.episodes.append(episode)
        if self.on_episode is not None:
            self.on_episode(episode)
        return episode


async def run_math_agent(
    client: AsyncClient,
    *,
    sessions: int,
    concurrency: int = 16,
    group_size: int = 8,
    seed: int = 0,
    max_tokens: int = 16,
    temperature: float = 1.0,
    length_varying: bool = False,
    run_id: str | None = None,
) -> AgentLog:
    """``sessions`` sessions (whole groups) on the run (default: the server's default run)."""
    run = await client.get_run(run_id) if run_id else await _default_run(client)
    problems = arithmetic.problems(seed, length_varying=length_varying)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as http:
        agent = MathAgent(
            client,
            http,
            run["model"],
            run["id"],
            problems,
            concurrency=concurrency,
            group_size=group_size,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
        )
        return await agent.run(limit=sessions)


async def _default_run(client: AsyncClient) -> dict:
    runs = await client.list_runs()
    return dict(next(run for run in runs if run["is_default"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="proxrl's root URL (not its /v1)")
    parser.add_argument("--admin-key", default=None, help="admin key or run key")
    parser.add_argument("--sessions", type=int, default=64, help="rounded up to whole groups")
    parser.add_argument("--group-size", type=int, default=8, help="sessions per GRPO group")
    parser.add_argument("--concurrency", type=int, default=16, help="sessions in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--length-varying", action="store_true", help="chains of 1-8 additions (long tail)"
    )
    parser.add_argument("--run-id", default=None, help="default: the server's default run")
    args = parser.parse_args(argv)

    async def go() -> AgentLog:
        async with AsyncClient(args.base_url, args.admin_key, max_retries=MAX_RETRIES) as client:
            return await run_math_agent(
                client,
                sessions=args.sessions,
                concurrency=args.concurrency,
                group_size=args.group_size,
                seed=args.seed,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                length_varying=args.length_varying,
                run_id=args.run_id,
            )

    log = asyncio.run(go())
    for episode in log.episodes:
        print(
            f"{episode.session_id} {episode.group_id:10} {episode.problem.question:14} -> "
            f"{episode.text!r:28} reward={episode.reward:.1f}"
        )
    rewards = log.rewards
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    print(f"{len(rewards)} sessions in groups of {args.group_size}; mean reward {mean:.3f}.")


if __name__ == "__main__":
    main()
