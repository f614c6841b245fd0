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

and one inside the workers, reached by every rank (each writes ``paused-at-rank<R>``):

    mid_step           a worker's train_step is under way: proximal logprobs done, no
                       optimizer step yet (its step is the worker's step count + 1)

Workers run wherever Ray puts them: they write their marker in ``$PROXRL_TRAINER_PAUSE_DIR``
(the driver passes both variables to them), default ``output_dir`` for the driver's points.

Unset (always, outside tests), reaching a point is one dictionary lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POINTS = ("claimed", "trained", "published", "checkpoint_saved", "checkpointed", "mid_step")
VARIABLE = "PROXRL_TRAINER_PAUSE_AT"
DIRECTORY = "PROXRL_TRAINER_PAUSE_DIR"
MARKER = "paused-at"


def reach(point: str, step: int, output_dir: Path, marker: str = MARKER) -> None:
    """Stop here for good if the environment names this point of this step."""
    assert point in POINTS, point
    if os.environ.get(VARIABLE) != f"{point}@{step}":
        return
    (Path(os.environ.get(DIRECTORY, output_dir)) / marker).write_text(point)
    while True:  # until the test kills the process
        time.sleep(3600)
