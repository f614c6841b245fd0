"""A second synthetic task for the tiny model, beside ``arithmetic.py``'s addition:
subtraction of one digit from a larger one, ``"9-4="`` → ``"5"`` (never negative).

The problems are ``arithmetic.Problem``s (``task_id`` ``sub-9-4``), so ``arithmetic.messages``
and ``arithmetic.reward`` serve them as they are, and the math agent asks them unchanged. Only
the worked answer differs: ``"9-4=5"``, the subtraction restated before its result (as
``arithmetic.solution`` restates an addition). The two-run LoRA demo (``examples/demo_lora.py``)
trains one run on each task from a model warmed up on both.

Pure standard library. Import it as ``import subtraction`` from a script in
``examples/agents/``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import arithmetic

__all__ = ["problems", "solution", "warmup_examples"]


def problems(seed: int, *, max_operand: int = 9) -> Iterator[arithmetic.Problem]:
    """An endless, seeded stream of ``a-b=`` with ``0 <= b <= a <= max_operand``."""
    rng = random.Random(seed)
    while True:
        first, second = rng.randint(0, max_operand), rng.randint(0, max_operand)
        high, low = max(first, second), min(first, second)
        question, task_id = f"{high}-{low}=", f"sub-{high}-{low}"
        yield arithmetic.Problem(question, str(high - low), task_id, (high, low))


def solution(problem: arithmetic.Problem) -> str:
    """The worked answer the warm-up teaches: ``"9-4=5"``."""
    return problem.question + problem.answer


def warmup_examples(count: int, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    """``count`` supervised examples (messages, worked answer) for ``trainer.warmup``."""
    stream = problems(seed)
    drawn = [next(stream) for _ in range(count)]
    return [(arithmetic.messages(problem), solution(problem)) for problem in drawn]
