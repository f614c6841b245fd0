"""A multi-turn agent with a calculator tool, trained through proxrl.

Each session asks one arithmetic question (generated here from a seed, nothing downloaded).
The model may call the ``calculator`` tool through OpenAI tool calls; the agent evaluates the
expression with a small ``ast`` evaluator (never ``eval``), sends the result back as a ``tool``
message with the call's id, and asks again, until the model answers without a tool call or
``--max-turns`` is reached.

Rewards:

- the **session reward**: 1.0 when the last integer of the final answer is the exact result,
  else 0.0;
- a **per-turn reward** for every turn, posted by its completion id: +0.1 for well-formed tool
  calls whose results the model got to read, -0.1 for a malformed call (arguments that are not
  ``{"expression": str}``, an expression the calculator refuses, an unknown tool, or
  ``<tool_call>`` markup the proxy could not parse as a call), 0.0 otherwise. The trainer folds
  them into discounted returns with ``algorithm.discount`` (G_t = r_t + discount * G_{t+1}, the
  session reward added to the last turn); ``--discount`` only shows the returns it would give.

The model behind the proxy may be weak (the tiny model is random): the agent accepts any
output, calls or no calls, and never fails on what the model wrote.

    python examples/agents/tool_agent.py --base-url http://127.0.0.1:8000 --admin-key KEY \\
        --sessions 16 --concurrency 4 --max-turns 4 --discount 0.9 --seed 0

The reusable entry point is ``run_tool_agent(client, sessions=...)``. It knows the proxy only
through ``client_sdk`` and a stock ``openai.OpenAI``.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import operator
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import openai

from client_sdk import Client

__all__ = [
    "CALCULATOR_TOOL",
    "SYSTEM_PROMPT",
    "CalculatorError",
    "Episode",
    "Question",
    "Step",
    "TurnRecord",
    "calculate",
    "discounted_returns",
    "final_answer",
    "format_number",
    "initial_messages",
    "make_questions",
    "read_reply",
    "run_episode",
    "run_tool_agent",
    "shaped_reward",
]

log = logging.getLogger("tool_agent")

SYSTEM_PROMPT = (
    "You solve arithmetic questions. Call the calculator tool to compute, then reply with "
    "the final number only."
)
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "For example: (17 + 25) * 3"}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
RETRY_HINT = (
    "That tool call could not be read. Call the calculator as "
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call> '
    "or reply with the final number only."
)
TOOL_CALL_MARKUP = "<tool_call>"
TOOL_REWARD = 0.1
MALFORMED_PENALTY = -0.1


# --------------------------------------------------------------------------------------------
# the calculator: arithmetic on numbers, nothing else


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator evaluates; the message says why."""


MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15  # every intermediate value stays below it, so nothing grows huge
MAX_EXPONENT = 64
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def calculate(expression: object) -> int | float:
    """The value of an arithmetic expression: int and float literals, + - * / // % **, unary
    + and -, parentheses. Anything else (names, calls, attributes, strings, booleans, huge
    numbers, division by zero) raises ``CalculatorError``; nothing is ever executed."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refused too
            raise CalculatorError(f"not a number: {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents above {MAX_EXPONENT} are refused")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("the result is too large") from exc
        return _bounded(value)
    raise CalculatorError(f"unsupported: {ast.unparse(node)!r}")


def _bounded(value: object) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    assert isinstance(value, int | float)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    if abs(value) >= MAX_MAGNITUDE:
        raise CalculatorError(f"the result is not below {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def format_number(value: int | float) -> str:
    """A result as the tool message says it: integers without a decimal point."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


# --------------------------------------------------------------------------------------------
# the task


@dataclass(frozen=True)
class Question:
    expression: str  # "37 * 12 - 5"
    answer: int
    task_id: str  # names the question; sessions of one GRPO group share it

    @property
    def text(self) -> str:
        return f"What is {self.expression}?"


_FORMS = ("{a} * {b} + {c}", "{a} * {b} - {c}", "({a} + {b}) * {c}", "{a} * {b} * {c}")


def make_questions(count: int, seed: int) -> list[Question]:
    """``count`` seeded two-step questions with integer answers: the same seed, the same list."""
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        form = rng.choice(_FORMS)
        expression = form.format(a=rng.randint(2, 99), b=rng.randint(2, 99), c=rng.randint(2, 99))
        answer = calculate(expression)
        assert isinstance(answer, int)
        questions.append(Question(expression, answer, "calc-" + expression.replace(" ", "")))
    return questions


def initial_messages(question: Question) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question.text},
    ]


_INTEGER = re.compile(r"-?\d+")


def final_answer(text: str | None) -> int | None:
    """The last integer in the final reply, or None when it has none."""
    numbers = _INTEGER.findall(text or "")
    return int(numbers[-1]) if numbers else None


# --------------------------------------------------------------------------------------------
# one reply: which calls are well-formed, what goes back to the model


@dataclass(frozen=True)
class Step:
    """What the agent makes of one assistant reply."""

    assistant: dict[str, Any]  # the reply as it goes back into the conversation
    follow_up: list[dict[str, Any]]  # tool messages, or a hint after unreadable markup
    calls: int  # tool calls the reply made
    malformed: int  # of them, or unparsed <tool_call> markup, what the agent could not run
    final: bool  # no tool call and no markup: the reply is the answer

    @property
    def tool_round_trip(self) -> bool:
        """The reply called a tool and its results go back as tool messages."""
        return any(message["role"] == "tool" for message in self.follow_up)


def read_reply(content: str | None, tool_calls: list[dict[str, Any]] | None) -> Step:
    """Run the calculator for each call of a reply (``tool_calls`` in OpenAI's shape, as
    dicts) and say what goes back to the model. Any shape of call is accepted: a call that
    cannot be run gets a tool message saying why, and counts as malformed."""
    calls = list(tool_calls or [])
    if not calls:
        if content is not None and TOOL_CALL_MARKUP in content:
            # The model tried to call a tool, but the proxy could not parse the block.
            hint = {"role": "user", "content": RETRY_HINT}
            return Step({"role": "assistant", "content": content}, [hint], 0, 1, final=False)
        return Step({"role": "assistant", "content": content}, [], 0, 0, final=True)
    follow_up: list[dict[str, Any]] = []
    sent_calls: list[dict[str, Any]] = []
    malformed = 0
    for index, call in enumerate(calls):
        call = call if isinstance(call, dict) else {}
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        call_id = str(call.get("id") or f"call_{index}")
        name, arguments = function.get("name"), function.get("arguments")
        try:
            result = format_number(_run_tool(name, arguments))
        except CalculatorError as exc:
            result, malformed = f"error: {exc}", malformed + 1
        follow_up.append({"role": "tool", "tool_call_id": call_id, "content": result})
        sent_calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": str(name or ""), "arguments": _as_text(arguments)},
            }
        )
    assistant: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": sent_calls}
    return Step(assistant, follow_up, calls=len(calls), malformed=malformed, final=False)


def _run_tool(name: object, arguments: object) -> int | float:
    if name != "calculator":
        raise CalculatorError(f"unknown tool {name!r}: the only tool is 'calculator'")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise CalculatorError("the arguments are not JSON") from exc
    if not isinstance(arguments, dict) or set(arguments) != {"expression"}:
        raise CalculatorError('the arguments must be {"expression": "..."}')
    return calculate(arguments["expression"])


def _as_text(arguments: object) -> str:
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments)
    except (TypeError, ValueError):
        return "{}"


def shaped_reward(step: Step, results_read: bool) -> float:
    """The per-turn reward: -0.1 if anything was malformed, +0.1 for well-formed calls whose
    results the model read in a later turn, else 0.0."""
    if step.malformed:
        return MALFORMED_PENALTY
    if step.calls and results_read:
        return TOOL_REWARD
    return 0.0


def discounted_returns(
    turn_rewards: list[float], session_reward: float, discount: float
) -> list[float]:
    """G_t = r_t + discount * G_{t+1}, the session reward added to the last turn: what the
    trainer computes with ``algorithm.discount`` (shown here, not sent anywhere)."""
    rewards = list(turn_rewards)
    if rewards:
        rewards[-1] += session_reward
    returns, following = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        following = rewards[t] + discount * following
        returns[t] = following
    return returns


# --------------------------------------------------------------------------------------------
# one episode, then many


@dataclass
class TurnRecord:
    completion_id: str
    step: Step
    reward: float = 0.0


@dataclass
class Episode:
    question: Question
    session_id: str = ""
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: int | None = None
    reward: float = 0.0
    stopped: str = ""  # "answered", "max_turns" or "refused" (the proxy refused the request)

    @property
    def turn_rewards(self) -> dict[str, float]:
        """Per-turn rewards by completion id, as posted."""
        return {turn.completion_id: turn.reward for turn in self.turns}

    @property
    def tool_calls(self) -> int:
        return sum(turn.step.calls for turn in self.turns)

    @property
    def malformed(self) -> int:
        return sum(turn.step.malformed for turn in self.turns)

    @property
    def tool_round_trips(self) -> int:
        """Turns whose tool results the model read in a later turn."""
        return sum(turn.step.tool_round_trip for turn in self.turns[:-1])


def run_episode(
    model: openai.OpenAI,
    model_name: str,
    question: Question,
    *,
    max_turns: int = 4,
    max_tokens: int = 48,
    temperature: float = 1.0,
    messages: list[dict[str, Any]] | None = None,
) -> Episode:
    """Talk to the model until it answers without a tool call or ``max_turns`` replies came.

    ``messages`` continues a conversation instead of starting one (it may already hold
    assistant tool calls and tool results). Rewards are computed, not posted. A request the
    proxy refuses (400: say, the conversation outgrew the context) ends the episode there."""
    episode = Episode(question, messages=list(messages or initial_messages(question)))
    text: str | None = None
    episode.stopped = "max_turns"
    for _ in range(max_turns):
        try:
            reply = model.chat.completions.create(
                model=model_name,
                messages=cast(Any, episode.messages),  # plain dicts in OpenAI's shape
                tools=cast(Any, [CALCULATOR_TOOL]),
                tool_choice="auto",
                max_tokens=max_tokens,
                temperature=temperature,
            )
        except openai.BadRequestError as exc:
            log.warning("the proxy refused a turn of %s: %s", question.task_id, exc)
            episode.stopped = "refused"
            break
        message = reply.choices[0].message if reply.choices else None
        content = message.content if message else None
        calls = [call.model_dump() for call in (message.tool_calls or [])] if message else []
        step = read_reply(content, calls)
        episode.messages += [step.assistant, *step.follow_up]
        episode.turns.append(TurnRecord(reply.id, step))
        if step.final:
            text, episode.stopped = content, "answered"
            break
    for index, turn in enumerate(episode.turns):
        turn.reward = shaped_reward(turn.step, results_read=index + 1 < len(episode.turns))
    episode.answer = final_answer(text)
    episode.reward = 1.0 if episode.answer == question.answer else 0.0
    return episode


def run_tool_agent(
    client: Client,
    *,
    sessions: int,
    concurrency: int = 4,
    max_turns: int = 4,
    seed: int = 0,
    group_size: int = 1,
    max_tokens: int = 48,
    temperature: float = 1.0,
    run_id: str | None = None,
    model_name: str | None = None,
) -> list[Episode]:
    """Run ``sessions`` episodes, ``concurrency`` at a time, one proxrl session each; post each
    turn's shaped reward by completion id and the session reward, and end the session. With
    ``group_size`` > 1, each question is asked that many times, its sessions one GRPO group
    (same task_id and group_id). Episodes come back in question order."""
    questions = make_questions(-(-sessions // group_size), seed)
    jobs = [questions[index // group_size] for index in range(sessions)]

    def one(question: Question) -> Episode:
        group_id = question.task_id if group_size > 1 else None
        with client.session(run_id=run_id, task_id=question.task_id, group_id=group_id) as s:
            name = model_name or client.get_run(s.run_id)["model"]
            with s.openai() as model:
                episode = run_episode(
                    model,
                    name,
                    question,
                    max_turns=max_turns,
                    max_tokens=max_tokens,
                    temperature=temperature,
                )
            episode.session_id = s.id
            for turn in episode.turns:
                s.reward(turn.reward, completion_id=turn.completion_id)
            s.reward(episode.reward)
        return episode

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, jobs))


# --------------------------------------------------------------------------------------------
# the command


def _describe(episode: Episode, discount: float) -> str:
    returns = discounted_returns(list(episode.turn_rewards.values()), episode.reward, discount)
    return (
        f"{episode.session_id} {episode.question.text!r:26} turns={len(episode.turns)} "
        f"calls={episode.tool_calls} malformed={episode.malformed} "
        f"answer={episode.answer} reward={episode.reward:.1f} "
        f"turn_rewards={[round(r, 2) for r in episode.turn_rewards.values()]} "
        f"returns={[round(g, 3) for g in returns]} ({episode.stopped})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="proxrl's root URL (not its /v1)")
    parser.add_argument("--admin-key", default=None, help="admin key or run key")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=1, help="sessions per question")
    parser.add_argument(
        "--discount",
        type=float,
        default=0.9,
        help="shown returns only: the trainer discounts with its own algorithm.discount",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--run-id", default=None, help="default: the server's default run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    with Client(args.base_url, args.admin_key) as client:
        episodes = run_tool_agent(
            client,
            sessions=args.sessions,
            concurrency=args.concurrency,
            max_turns=args.max_turns,
            seed=args.seed,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            run_id=args.run_id,
        )
    for episode in episodes:
        print(_describe(episode, args.discount))
    solved = sum(episode.reward for episode in episodes)
    print(
        f"{len(episodes)} sessions: {solved:.0f} solved, "
        f"{sum(e.tool_calls for e in episodes)} tool calls "
        f"({sum(e.malformed for e in episodes)} malformed), "
        f"{sum(e.tool_round_trips for e in episodes)} tool results read by the model."
    )
    print(
        "Per-turn rewards were posted by completion id; the trainer discounts them with "
        f"algorithm.discount (returns above use --discount {args.discount})."
    )


if __name__ == "__main__":
    main()
