"""An agent built on LangChain, trained through proxrl with no change to the framework.

LangChain's ``ChatOpenAI`` (package ``langchain-openai``) is used as it ships: the only thing
proxrl asks of it is ``base_url`` and ``api_key``, pointed at a proxrl session. Everything the
model samples through it is recorded by the proxy; the agent then posts the session's reward
(1.0 for the exact sum, else 0.0) with ``client_sdk`` and ends the session. The same two
settings point any other framework (the OpenAI Agents SDK, LlamaIndex, ...) at proxrl.

    pip install langchain-openai
    python examples/agents/framework_agent.py --base-url http://127.0.0.1:8000 \\
        --admin-key KEY --sessions 4

The task is ``arithmetic.py``'s plain format ("47+38=" → "85"), the one the math agent uses.
The reusable entry point is ``run_framework_agent(client, sessions=...)``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import arithmetic
from langchain_openai import ChatOpenAI

from client_sdk import Client

__all__ = ["FrameworkEpisode", "chat_model", "run_framework_agent"]


@dataclass(frozen=True)
class FrameworkEpisode:
    session_id: str
    problem: arithmetic.Problem
    text: str
    completion_id: str | None  # the chat completion's id, as LangChain reports it
    reward: float


def chat_model(
    base_url: str, api_key: str, model: str, *, max_tokens: int, temperature: float
) -> ChatOpenAI:
    """LangChain's stock OpenAI chat model, on one proxrl session."""
    return ChatOpenAI(
        base_url=base_url,  # the session's base_url, ending in /v1
        api_key=api_key,  # the session's key
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        timeout=120,
        max_retries=2,
    )


def run_framework_agent(
    client: Client,
    *,
    sessions: int,
    seed: int = 0,
    max_tokens: int = 8,
    temperature: float = 1.0,
    run_id: str | None = None,
    model: str | None = None,
) -> list[FrameworkEpisode]:
    """One proxrl session per problem: ask through LangChain, reward the session, end it.
    ``model`` is the name the agent asks for (any name is served; default: the run's model)."""
    episodes = []
    for problem in arithmetic.generate(sessions, seed):
        with client.session(run_id=run_id, task_id=problem.task_id) as session:
            llm = chat_model(
                session.base_url,
                session.api_key,
                model or client.get_run(session.run_id)["model"],
                max_tokens=max_tokens,
                temperature=temperature,
            )
            reply = llm.invoke(arithmetic.messages(problem))
            text = reply.content if isinstance(reply.content, str) else str(reply.content)
            reward = arithmetic.reward(problem, text)
            session.reward(reward)
        completion_id = reply.response_metadata.get("id")
        episodes.append(FrameworkEpisode(session.id, problem, text, completion_id, reward))
    return episodes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="proxrl's root URL (not its /v1)")
    parser.add_argument("--admin-key", default=None, help="admin key or run key")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--run-id", default=None, help="default: the server's default run")
    parser.add_argument(
        "--model", default=None, help="the model name to ask for (default: the served one's)"
    )
    args = parser.parse_args(argv)

    with Client(args.base_url, args.admin_key) as client:
        episodes = run_framework_agent(
            client,
            sessions=args.sessions,
            seed=args.seed,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            run_id=args.run_id,
            model=args.model,
        )
    for episode in episodes:
        print(
            f"{episode.session_id} {episode.problem.question:8} -> {episode.text!r:24} "
            f"reward={episode.reward:.1f} ({episode.completion_id})"
        )
    solved = sum(episode.reward for episode in episodes)
    print(f"{len(episodes)} LangChain sessions, {solved:.0f} solved; each ended and rewarded.")


if __name__ == "__main__":
    main()
