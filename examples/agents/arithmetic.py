"""A synthetic arithmetic task for the tiny model: seeded problems, the agent's messages, and
the exact-match reward.

Two formats:

- **plain** (the default): ``"47+38="`` → ``"85"``. Short prompts and answers of one to three
  digit tokens, so serving and training are cheap, and a short supervised warm-up leaves the
  tiny model partly right: the place where reinforcement learning shows.
- **length-varying** (``length_varying=True``): a list of 1 to 8 numbers added step by step,
  one running sum a line (``"3+14=17\\n17+7=24"``). The number of terms follows a long-tailed
  distribution, so completion lengths vary from a few tokens to about 70: the workload that
  separates synchronous from asynchronous RL. The reward is still the exactness of the final
  answer (what follows the last ``=``).

Pure standard library: it knows nothing about models, tokenizers or the proxy. Import it as
``import arithmetic`` from a script in ``examples/agents/``, or by path from elsewhere.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "TERM_WEIGHTS",
    "Problem",
    "generate",
    "messages",
    "parse_answer",
    "problems",
    "reward",
    "solution",
    "warmup_examples",
]

# Long tail of the number of terms (1..8) in the length-varying format: most problems are
# short, a few are long, as in real agent workloads.
TERM_WEIGHTS = (0.30, 0.22, 0.15, 0.10, 0.08, 0.06, 0.05, 0.04)
# The final answer: the integer after the last "=", or the whole text when it has no "=".
_ANSWER = re.compile(r"(?:.*=)?\s*(-?\d+)\s*", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    question: str  # what the user message says, e.g. "47+38="
    answer: str  # the exact answer, e.g. "85"
    task_id: str  # names the problem; the sessions of one GRPO group share it
    terms: tuple[int, ...]  # the numbers to add
    length_varying: bool = False


def problems(seed: int, *, max_operand: int = 9, length_varying: bool = False) -> Iterator[Problem]:
    """An endless, seeded stream of problems: the same seed gives the same problems.

    Plain problems add two numbers in ``0..max_operand``. Length-varying ones add 1 to 8
    numbers (``TERM_WEIGHTS``) in ``1..max_operand``.
    """
    rng = random.Random(seed)
    while True:
        if length_varying:
            count = rng.choices(range(1, len(TERM_WEIGHTS) + 1), weights=TERM_WEIGHTS)[0]
            terms = tuple(rng.randint(1, max_operand) for _ in range(count))
        else:
            terms = (rng.randint(0, max_operand), rng.randint(0, max_operand))
        yield _problem(terms, length_varying)


def generate(
    count: int, seed: int, *, max_operand: int = 9, length_varying: bool = False
) -> list[Problem]:
    """The first ``count`` problems of ``problems(seed, ...)``."""
    stream = problems(seed, max_operand=max_operand, length_varying=length_varying)
    return [next(stream) for _ in range(count)]


def _problem(terms: tuple[int, ...], length_varying: bool) -> Problem:
    question = "+".join(str(term) for term in terms) + "="
    prefix = "chain" if length_varying else "add"
    task_id = f"{prefix}-" + "-".join(str(term) for term in terms)
    return Problem(question, str(sum(terms)), task_id, terms, length_varying)


def messages(problem: Problem) -> list[dict[str, str]]:
    """The chat messages the agent sends: the question alone. (A system message would more
    than double the prompt, and every prompt token costs the tiny model's training and
    serving time on a CPU; the warm-up teaches the format instead.)"""
    return [{"role": "user", "content": problem.question}]


def solution(problem: Problem) -> str:
    """The correct completion, as the supervised warm-up teaches it: one line per addition,
    each adding the next term to the running sum (``"3+5=8"``, ``"3+4=7\\n7+6=13"``); a
    single term is answered by itself.

    Restating the addition before its result puts both operands right before the answer
    token, where a tiny model finds them early: the warm-up learns it in about half the steps,
    and far more consistently across seeds, than a bare ``"8"``.
    """
    if len(problem.terms) == 1:
        return problem.answer
    lines, total = [], problem.terms[0]
    for term in problem.terms[1:]:
        lines.append(f"{total}+{term}={total + term}")
        total += term
    return "\n".join(lines)


def parse_answer(text: str) -> str | None:
    """The final answer in a completion: the integer after the last ``=``, or the whole text
    when it is an integer and has no ``=``; None when the completion does not end that way."""
    match = _ANSWER.fullmatch(text)
    if match is None:
        return None
    return match.group(1)


def reward(problem: Problem, text: str) -> float:
    """1.0 when the completion's final answer is exactly the problem's (as written: "085" is
    not "85"), else 0.0."""
    return 1.0 if parse_answer(text) == problem.answer else 0.0


def warmup_examples(
    count: int, seed: int, *, max_operand: int = 9, length_varying: bool = False
) -> list[tuple[list[dict[str, str]], str]]:
    """``count`` supervised examples (messages, correct completion) for ``trainer.warmup``."""
    drawn = generate(count, seed, max_operand=max_operand, length_varying=length_varying)
    return [(messages(problem), solution(problem)) for problem in drawn]
