"""The demo's starting model: the tiny model after a short supervised warm-up on the plain
arithmetic task (``trainer.warmup.cached_warm_start``, cached, so a second run starts at once).

``proxrl demo`` and ``bench/staleness_ablation.py`` both start from it, under one cache key.
Import it as ``import warm_start`` from a script in ``examples/agents/``, or by path from
elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import arithmetic

if TYPE_CHECKING:
    from rich.progress import TaskID

# The warm-up stops part-way: 180 steps leave the tiny model partly right (it samples the right
# sum about 0.4 of the time at temperature 1 and 0.55 greedily, measured on 400 problems).
WARMUP = {"size": "tiny", "steps": 180, "lr": 3e-3, "batch_size": 32}
WARMUP_EXAMPLES = 4000
# This clone's warm-up cache: the demo's --cache default, and `proxrl model init --warm-start`'s
# (server/cli/commands.py).
CACHE_DIR = Path(__file__).resolve().parents[2] / ".proxrl-cache"


def two_task_examples(seed: int) -> list:
    """The two-run LoRA demo's warm-up: as many addition as subtraction examples
    (``subtraction.py``), shuffled, ``WARMUP_EXAMPLES`` in all. With ``WARMUP``'s steps the model
    samples the right answer about a quarter of the time on each task (measured: 0.26 on 400
    additions and 0.27 on 400 subtractions, temperature 1)."""
    import random

    import subtraction

    half = WARMUP_EXAMPLES // 2
    examples = arithmetic.warmup_examples(half, seed=1000 + seed)
    examples += subtraction.warmup_examples(half, seed=2000 + seed)
    random.Random(seed).shuffle(examples)
    return examples


def warm_model(
    cache: Path, seed: int, *, progress: bool = True, examples: list | None = None
) -> Path:
    """The tiny model after the warm-up on ``examples`` (default: the addition task's; cached
    under ``cache``), with a progress bar on stderr while it trains unless ``progress`` is
    False."""
    from server.common.progress import progress_bar
    from trainer.warmup import cached_warm_start

    if examples is None:
        examples = arithmetic.warmup_examples(WARMUP_EXAMPLES, seed=1000 + seed)
    if not progress:
        return cached_warm_start(cache, examples, seed=seed, threads=2, **WARMUP)
    bar = progress_bar(
        "{task.description}", "steps", "loss {task.fields[loss]:.3f}", rate_format=".1f"
    )
    tasks: list[TaskID] = []  # the bar starts at the first step: a cached model shows none

    def on_step(done: int, steps: int, loss: float) -> None:
        if not tasks:
            bar.start()
            tasks.append(bar.add_task("warm-up", total=steps, loss=loss))
        bar.update(tasks[0], completed=done, loss=loss)

    try:
        return cached_warm_start(cache, examples, seed=seed, threads=2, on_step=on_step, **WARMUP)
    finally:
        if tasks:
            bar.stop()
