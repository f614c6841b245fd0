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
from trainer.rollback import (
    CannotRestore,
    discarded,
    new_rollbacks,
    plan_restore,
    served_weights,
    to_release,
)
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


# ----- a restart that finds a rollback, and sessions a checkpoint confirmed -------------------


def stopped_at_three(tmp_path: Path, server: RollingServer) -> None:
    """A trainer that trained claims c1, c2, c3 into versions 1, 2, 3 through the journal, as
    `Trainer.run` does, checkpointed after the first (c1 confirmed), then stopped."""
    t = trainer(tmp_path, server)
    t.workers = Workers()
    for version in (1, 2, 3):
        claim = Claim(f"c{version}", [f"s{version}a", f"s{version}b"])
        t.checkpoints.journal_claim(claim.claim_id, t.state.step, claim.size)  # as `claim`
        t.pending.append(claim)
        t.state.version = t.state.step = version
        t.mark_trained([claim])
        if version == 1:
            t.commit_checkpoint(t.save_checkpoint())


def restarted(tmp_path: Path, server: RollingServer) -> tuple:
    """A new trainer on the stopped one's output directory, resumed from its checkpoint as
    `Trainer.start` does."""
    t = trainer(tmp_path, server)
    t.workers = Workers()
    t.state = t.checkpoints.latest()[1]  # type: ignore[index]
    t.resume_claims()
    return t, t.workers


def released(server: RollingServer) -> set[str]:
    return {claim_id for name, claim_id in server.calls if name == "release"}


@pytest.mark.parametrize(
    ("rollbacks", "released_claims"),
    [
        ([], {"c2", "c3"}),  # the checkpoint's weights (version 1) hold neither
        ([[2, 4]], {"c3"}),  # version 2's files hold c2's update: it is not trained again
        ([[3, 4]], set()),
        ([[1, 4]], {"c2", "c3"}),
        ([[2, 4], [4, 5]], {"c3"}),  # version 4 serves version 2's weights: it holds c2
        ([[1, 4], [4, 5]], {"c2", "c3"}),
    ],
)
def test_a_restart_releases_only_the_claims_the_rollback_it_finds_discarded(
    tmp_path, rollbacks, released_claims
):
    """Checkpointed at version 1, trained c2 -> 2 and c3 -> 3, stopped; the run rolled back
    meanwhile. Each session trains once along the lineage served: the claims of versions the
    restored weights hold are confirmed, the others released, none both."""
    paths = {v: str(tmp_path / f"v{v}") for v in range(1, 6)}
    for path in paths.values():
        Path(path).mkdir()
    server = RollingServer(rollbacks, paths)
    stopped_at_three(tmp_path / "out", server)
    server.calls.clear()
    t, _ = restarted(tmp_path / "out", server)
    assert released(server) == released_claims
    confirmed = {claim_id for name, claim_id in server.calls if name == "confirm"}
    assert confirmed == {"c2", "c3"} - released_claims
    assert t.pending == [] and t.trained_into == {}
    assert t.checkpoints.journalled() == [] and t.checkpoints.journalled_trained() == {}
    if rollbacks:  # the checkpoint of the rollback covers the claims kept
        covered = {c["claim_id"] for c in t.checkpoints.latest()[1].covered_claims}  # type: ignore[index]
        assert covered == confirmed and t.state.version == rollbacks[-1][1]


def test_a_restart_restores_the_files_that_hold_the_claims_it_keeps(tmp_path):
    """The reviewer's case: rolled back to 2 (served as 4) while the trainer was stopped."""
    published = tmp_path / "v2"
    published.mkdir()
    server = RollingServer([[2, 4]], {2: str(published)})
    stopped_at_three(tmp_path / "out", server)
    server.calls.clear()
    t, workers = restarted(tmp_path / "out", server)
    assert ("load_published", str(published)) in workers.calls
    assert [c for c in server.calls if c[0] in ("release", "confirm")] == [
        ("release", "c3"),
        ("confirm", "c2"),
    ]
    assert t.state.consumed_into == [[1, 2], [2, 2]]


def test_a_second_stop_before_the_rollback_s_checkpoint_keeps_the_claims_journalled(tmp_path):
    """Stopped again after settling the journal, before following the rollback: the claims
    trained since the checkpoint stay in the journal, and the next restart decides the same."""
    published = tmp_path / "v2"
    published.mkdir()
    server = RollingServer([[2, 4]], {2: str(published)})
    stopped_at_three(tmp_path / "out", server)
    first = trainer(tmp_path / "out", server)
    first.state = first.checkpoints.latest()[1]  # type: ignore[index]
    first._settle_journal()  # and stopped
    assert set(first.checkpoints.journalled_trained()) == {"c2", "c3"}
    server.calls.clear()
    restarted(tmp_path / "out", server)
    assert released(server) == {"c3"} and ("confirm", "c2") in server.calls


def test_sessions_a_checkpoint_confirmed_into_discarded_versions_are_counted_and_told(
    tmp_path, caplog
):
    """Claims a checkpoint confirmed are consumed on the server and cannot be given back: a
    rollback past them loses their sessions, which the trainer counts as dropped
    (``rolled_back``: the step records' totals) and names in a warning. A dropped session of
    such a claim was never trained: it is not counted again."""
    published = tmp_path / "v1"
    published.mkdir()
    server = RollingServer([[1, 4]], {1: str(published)})
    t, _ = trained_to_three(tmp_path, server)
    t.pending[1].dropped = {"s2b": "stale: 3 versions behind"}
    t.commit_checkpoint(t.save_checkpoint())  # checkpoint_every reached at step 3
    assert t.state.consumed_into == [[1, 2], [2, 1], [3, 2]]
    server.calls.clear()
    with caplog.at_level(logging.WARNING, logger="proxrl.trainer"):
        assert t.follow_rollbacks()
    assert released(server) == set()  # consumed: nothing the server would take back
    assert t.state.total_dropped_sessions == {"rolled_back": 3}
    assert t.state.consumed_into == [[1, 2]]
    saved = t.checkpoints.latest()[1]  # type: ignore[index]
    assert saved.total_dropped_sessions == {"rolled_back": 3}
    assert "3 sessions trained into versions after 1 were already confirmed" in caplog.text
    assert "checkpoint_every" in caplog.text


def test_only_versions_after_the_one_whose_weights_are_served_count_as_lost():
    assert served_weights(5, [[1, 4], [4, 5]]) == 1
    assert served_weights(3, [[1, 4]]) == 3
    kept, lost = discarded([[1, 2], [2, 1], [5, 4]], 2)
    assert (kept, lost) == ([[1, 2], [2, 1]], 4)
