"""Following a rollback of the run: what to restore the weights from, and which claims to give
back.

``POST /rl/runs/{id}/rollback {"version": c}`` publishes version r that serves c's weights (the
run's ``rollbacks`` list the pairs (c, r)). The trainer that trained the versions after c must
go on from c's weights, as r: it restores them from its own checkpoint of version c if one is
left (optimizer state included), else from c's published files (an adapter or a weights
directory) with a fresh optimizer state, and from the base model for c = 0; it gives back the
claims it trained into versions after c that no checkpoint confirmed, so their sessions are
claimed again and trained on the restored weights (each session trained once along the lineage
the run serves), and confirms those it trained into c or before (the restored weights hold
them); and it counts (c, r) as a republish (``trainer.staleness``). A restarted trainer decides
the same way for the claims its journal holds, once it knows the rollback to follow.

The sessions of claims a checkpoint already confirmed (consumed) that trained into versions after
c cannot be given back: the server hands a consumed session out no more. They are lost to the
lineage; the trainer counts them (`discarded`) and says so. Pure: what the trainer has and what
the server says in, decisions out (``trainer.loop`` acts on them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint import TrainerState

# The reason code the trainer's dropped-session totals count the sessions of `discarded` under.
ROLLED_BACK = "rolled_back"


class CannotRestore(RuntimeError):
    """Neither a checkpoint nor the published files of the version rolled back to are left."""


@dataclass(frozen=True)
class Restore:
    """Where version ``source``'s weights come from, to be served on as ``version``: this
    trainer's ``checkpoint`` of it, else its published ``files``; neither: the base model."""

    source: int
    version: int
    checkpoint: Path | None = None
    files: str | None = None

    def says(self) -> str:
        """The log line's account of it."""
        if self.checkpoint is not None:
            where = f"its checkpoint {self.checkpoint} (optimizer state included)"
        elif self.files is not None:
            where = f"its published files {self.files} (a fresh optimizer state: no checkpoint)"
        else:
            where = "the base model (a fresh optimizer state)"
        return (
            f"the run was rolled back to version {self.source}, served as version "
            f"{self.version}: restored the weights of version {self.source} from {where}"
        )


def new_rollbacks(
    known: Iterable[Iterable[int]], listed: Iterable[Sequence[int]], version: int
) -> list[list[int]]:
    """The run's rollbacks (``listed``: [source, version] pairs, oldest first) this trainer has
    not followed yet (``known``: its republishes, which hold every rollback it followed) and
    that came after the version its weights are at (``version``: one before is history its
    weights do not descend from, as for a trainer started afresh on a run rolled back once)."""
    seen = [list(pair) for pair in known]
    return [list(pair) for pair in listed if list(pair) not in seen and pair[1] > version]


def plan_restore(
    source: int,
    version: int,
    checkpoints: Iterable[tuple[Path, TrainerState]],
    published: str | None,
    exists: Callable[[str], bool] = lambda path: Path(path).exists(),
) -> Restore:
    """Where to restore ``source``'s weights from: the newest of this trainer's ``checkpoints``
    at that version, else the version's ``published`` directory (the path the server recorded)
    where it still exists, else the base for version 0; else ``CannotRestore``, naming both."""
    own = [path for path, state in checkpoints if state.version == source]
    if own:
        return Restore(source, version, checkpoint=max(own))
    if published is not None and exists(published):
        return Restore(source, version, files=published)
    if source == 0:
        return Restore(source, version)
    files = f"its published files ({published!r}) are gone" if published else "no files"
    raise CannotRestore(
        f"The run was rolled back to version {source} (served as version {version}), and this "
        f"trainer cannot restore its weights: it has no checkpoint of version {source} "
        f"(keep_checkpoints keeps the newest only) and {files} (publish.keep_versions keeps "
        "the newest only). Roll back to a version the trainer still has, or restart it from a "
        "checkpoint."
    )


def served_weights(version: int, republished: Iterable[Sequence[int]]) -> int:
    """The version whose trained weights ``version`` serves: itself, or for one that serves an
    earlier version's again (``republished``: [earlier, version] pairs, a rollback's or a
    restart's), that one's, followed back. A rollback to a rollback's version holds only what
    the version it served again holds."""
    again = {new: old for old, new in republished}
    while version in again:
        version = again[version]
    return version


def to_release(trained_into: Mapping[str, int], source: int) -> list[str]:
    """The claims (``trained_into``: claim id -> the version its step published, for the claims
    no checkpoint confirmed yet) trained into versions after ``source``, which the rollback
    discarded: their sessions must train again. Those trained into ``source`` or before stay:
    the restored weights hold them."""
    return [claim_id for claim_id, version in trained_into.items() if version > source]


def discarded(consumed_into: Iterable[Sequence[int]], source: int) -> tuple[list[list[int]], int]:
    """Of ``consumed_into`` ([version, sessions] a checkpoint confirmed as trained into each
    version): those of ``source`` and before, which the restored weights hold, and how many
    sessions the versions after ``source`` held, consumed on the server and lost with them."""
    kept = [[version, sessions] for version, sessions in consumed_into if version <= source]
    lost = sum(sessions for version, sessions in consumed_into if version > source)
    return kept, lost
