"""The progress bar of long commands (`proxrl export`, the demo's warm-up): one line on stderr
with what is done of all, the command's own fields, the rate, the time spent and the time left.
rich estimates the rate and the time left from the recent updates, so a slow start is not
extrapolated. Knows nothing of what is being counted."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def progress_bar(label: str, unit: str, *fields: str, rate_format: str = ",.0f") -> Progress:
    """A bar whose tasks are described by ``label`` (a format string over ``task``, e.g.
    ``"exporting {task.description}"``), counted in ``unit`` (``"sessions"``): ``fields`` are
    more format strings over the task's fields (``"loss {task.fields[loss]:.3f}"``), shown
    between the count and the rate."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed or 0:{rate_format}} {unit}/s")

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        *(TextColumn(field) for field in fields),
        Rate(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
