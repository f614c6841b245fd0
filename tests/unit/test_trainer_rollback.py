"""A trainer following a rollback of its run (``trainer.rollback``, ``Trainer.follow_rollbacks``):
what it restores the weights from (its checkpoint of the version, else the version's published
files, else the base for 0, else a stop naming what is missing), which claims it gives back (those
trained into the discarded versions), and the republish it journals and checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_trained_share import RecordingServer, trainer
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.claims import Claim
from trainer.loop import Claimed
from trainer.rollback import CannotRestore, new_rollbacks, plan_restore, to_release
from trainer.server_api import VersionSuperseded


def checkpoints(tmp_path: Path, versions: dict[int, int]) -> Checkpoints:
    """Complete checkpoints, step -> the version it holds."""
    store = Checkpoints(tmp_path, keep=10)
    for step, version in versions.items():
        store.path(step).mkdir(parents=True)
        store.commit(store.path(step), TrainerState(run_id="run-1", step=step, version=version))
    return store


def test_a_checkpoint_of_the_version_comes_first_then_its_files_then_the_base(tmp_path):
    store = checkpoints(tmp_path, {1: 1, 2: 2, 3: 3})
    published = str(tmp_path / "v2")
    Path(published).mkdir()
    restore = plan_restore(2, 4, store.complete(), published)
    assert restore.checkpoint == store.path(2) and restore.files is None
    assert "optimizer state included" in restore.says()
    restore = plan_restore(2, 4, [], published)
    assert restore.checkpoint is None and restore.files == published
    assert "fresh optimizer state" in restore.says()
    base = plan_restore(0, 4, store.complete(), None)
    assert base.checkpoint is None and base.files is None and "base model" in base.says()


def test_the_newest_checkpoint_of_the_version_is_taken(tmp_path):
    store = checkpoints(tmp_path, {2: 2, 3: 2, 4: 3})  # a step that trained nothing kept 2
    assert plan_restore(2, 5, store.complete(), None).checkpoint == store.path(3)


def test_nothing_left_to_restore_stops_naming_both(tmp_path):
    store = checkpoints(tmp_path, {3: 3})
    with pytest.raises(CannotRestore) as refused:
        plan_restore(1, 4, store.complete(), str(tmp_path / "v1"))
    message = str(refused.value)
    assert "no checkpoint of version 1" in message and "v1" in message and "gone" in message
    with pytest.raises(CannotRestore, match="no files"):
        plan_restore(1, 4, [], None)


@given(
    trained=st.dictionaries(st.text(min_size=1, max_size=4), st.integers(1, 9), max_size=8),
    source=st.integers(0, 9),
)
def test_exactly_the_claims_trained_after_the_source_are_released(trained, source):
    released = to_release(trained, source)
    assert set(released) == {claim for claim, version in trained.items() if version > source}


def test_only_rollbacks_not_yet_followed_and_after_the_trainer_s_version_are_new():
    assert new_rollbacks([[3, 5]], [[1, 4], [3, 5]], 3) == [[1, 4]]
    assert new_rollbacks([[1, 4]], [[1, 4]], 3) == []
    assert new_rollbacks([], [(1, 4), (0, 6)], 3) == [[1, 4], [0, 6]]
    assert new_rollbacks([], [(1, 4), (0, 6)], 5) == [[0, 6]]  # started after the first
    assert new_rollbacks([], [(1, 4)], 7) == []  # a trainer started afresh at version 7


class RollingServer(RecordingServer):
    """A server whose run was rolled back (``rollbacks``), its versions at ``paths``."""

    def __init__(self, rollbacks: list[list[int]], paths: dict[int, str]) -> None:
        super().__init__()
        self.listed, self.paths = rollbacks, paths

    def rollbacks(self, run_id: str) -> list[list[int]]:
        return self.listed

    def version_path(self, run_id: str, version: int) -> str | None:
        return self.paths.get(version)

    def confirm(self, claim_id: str, dropped: dict[str, str] | None = None) -> dict:
        self._call("confirm", claim_id)
        return {"settled": 2}

    def trained(self, claim_id: str, version: int) -> int:
        self._call("trained", claim_id)
        return 2


class Workers:
    """The worker group's calls, recorded; a checkpoint save makes its directory."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call(self, name: str, *args):
        self.calls.append((name, *args))
        if name == "save_checkpoint":
            Path(args[0]).mkdir(parents=True, exist_ok=True)
        return [None]


def trained_to_three(tmp_path, server) -> tuple:
    """A trainer at version 3 after three steps, none checkpointed: claims c1, c2, c3 trained
    into versions 1, 2, 3."""
    t = trainer(tmp_path, server)
    t.workers = Workers()
    for version in (1, 2, 3):
        claim = Claim(f"c{version}", [f"s{version}a", f"s{version}b"])
        t.pending.append(claim)
        t.state.version = t.state.step = version
        t.mark_trained([claim])
    return t, t.workers


def test_following_restores_from_files_releases_the_discarded_claims_and_checkpoints(
    tmp_path, caplog
):
    published = tmp_path / "weights" / "v000001"
    published.mkdir(parents=True)
    server = RollingServer([[1, 4]], {1: str(published)})
    t, workers = trained_to_three(tmp_path, server)
    with caplog.at_level(logging.INFO):
        assert t.follow_rollbacks()
    assert ("load_published", str(published)) in workers.calls
    assert [c for c in server.calls if c[0] == "release"] == [("release", "c2"), ("release", "c3")]
    assert ("confirm", "c1") in server.calls  # trained into 1: the restored weights hold it
    assert t.state.version == 4 and t.state.republished == [[1, 4]]
    assert t.pending == [] and t.trained_into == {}
    path, saved = t.checkpoints.latest()  # type: ignore[misc]
    assert path == t.checkpoints.path(3) and (saved.version, saved.republished) == (4, [[1, 4]])
    assert saved.covered_claims == [{"claim_id": "c1", "sessions": 2, "dropped": {}}]
    assert "restored the weights of version 1 from its published files" in caplog.text
    assert not t.follow_rollbacks()  # followed once


def test_following_restores_from_its_checkpoint_of_the_version(tmp_path):
    server = RollingServer([[1, 4]], {1: "/gone"})
    t, workers = trained_to_three(tmp_path, server)
    store = checkpoints(tmp_path, {1: 1})
    t.checkpoints = store
    t.baseline.load_state_dict({})
    assert t.follow_rollbacks()
    assert ("load_checkpoint", str(store.path(1))) in workers.calls
    assert not any(call[0] == "load_published" for call in workers.calls)


def test_the_pair_is_journalled_before_the_checkpoint(tmp_path):
    """A crash after following but before its checkpoint commits keeps the republish."""
    server = RollingServer([[0, 4]], {})
    t, workers = trained_to_three(tmp_path, server)
    journalled: list[list[list[int]]] = []
    t.save_checkpoint = lambda: (
        journalled.append(t.checkpoints.journalled_republishes())
        or (  # type: ignore[method-assign]
            t.checkpoints.path(t.state.step)
        )
    )
    t.commit_checkpoint = lambda path: None  # type: ignore[method-assign]
    assert t.follow_rollbacks()
    assert journalled == [[[0, 4]]] and ("load_published", None) in workers.calls


def test_a_publish_refused_as_superseded_follows_the_rollback(tmp_path):
    published = tmp_path / "v1"
    published.mkdir()
    server = RollingServer([[1, 4]], {1: str(published)})
    t, _ = trained_to_three(tmp_path, server)
    step = Claim("c4", ["s4a", "s4b"])
    t.pending.append(step)
    t.state.version += 1  # as `publish` does before it is refused
    t.abandon_step(Claimed([step]), VersionSuperseded("HTTP 409"))
    assert ("release", "c4") in server.calls and t.state.version == 4


def test_a_superseded_publish_without_a_rollback_is_raised(tmp_path):
    t, _ = trained_to_three(tmp_path, RollingServer([], {}))
    t.state.version += 1
    with pytest.raises(VersionSuperseded):
        t.abandon_step(Claimed([]), VersionSuperseded("HTTP 409"))


def test_the_step_s_claims_stay_journalled_across_the_rollback_s_checkpoint(tmp_path):
    """A crash after following releases the claims of the step under way at restart."""
    published = tmp_path / "v1"
    published.mkdir()
    t, _ = trained_to_three(tmp_path, RollingServer([[1, 4]], {1: str(published)}))
    step = Claim("c4", ["s4a", "s4b"])
    t.checkpoints.journal_claim("c4", 3, 2)
    assert t.follow_rollbacks(Claimed([step]))
    assert t.checkpoints.journalled() == ["c4"]
