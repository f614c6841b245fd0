"""Named points in a training step where a crash test can stop the trainer dead.

``PROXRL_TRAINER_PAUSE_AT=<point>@<step>`` (for example ``published@3``) makes the trainer,
on reaching that point of that step, write the point's name to ``<output_dir>/paused-at`` and
sleep, so that a test can SIGKILL it exactly there and count what a restart does. The points, in
the order a step reaches them:

    claimed            the step's sessions are claimed (and journalled)
    trained            the workers updated the weights; nothing published
    published          the engines serve the new version; no checkpoint
    checkpoint_saved   the workers wrote the checkpoint's files; not yet marked complete
    checkpointed       the checkpoint is complete; its claims are not yet confirmed

Unset (always, outside tests), reaching a point is one dictionary lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POINTS = ("claimed", "trained", "published", "checkpoint_saved", "checkpointed")
VARIABLE = "PROXRL_TRAINER_PAUSE_AT"
MARKER = "paused-at"


def reach(point: str, step: int, output_dir: Path) -> None:
    """Stop here for good if the environment names this point of this step."""
    assert point in POINTS, point
    if os.environ.get(VARIABLE) != f"{point}@{step}":
        return
    (output_dir / MARKER).write_text(point)
    while True:  # until the test kills the process
        time.sleep(3600)
