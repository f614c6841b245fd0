"""The warm-up reports every step (``on_step``), so a progress bar can show the rate and the time
left from the first step on, not only a log line every ``log_every`` steps."""

from __future__ import annotations

import math

from trainer.warmup import warm_start

EXAMPLES = [([{"role": "user", "content": f"{a}+1="}], f"{a}+1={a + 1}") for a in range(6)]


def test_every_step_reaches_on_step_with_its_loss(tmp_path):
    seen: list[tuple[int, int, float]] = []
    warm_start(
        tmp_path / "model",
        EXAMPLES,
        steps=3,
        lr=1e-3,
        batch_size=2,
        on_step=lambda *a: seen.append(a),
    )
    assert [(done, steps) for done, steps, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(math.isfinite(loss) and loss > 0 for _, _, loss in seen)
    assert (tmp_path / "model" / "config.json").is_file()
