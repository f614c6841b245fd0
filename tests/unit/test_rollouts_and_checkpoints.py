"""Claimed sessions → samples (advantages over turn spans, staleness), and the claim journal."""

from __future__ import annotations

import pytest

from trainer.advantages import RunningBaseline
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.rollouts import build_batch


def row(prompt: int, turns: list[tuple[int, list[int], float | None]], row_index: int = 0):
    """A stored row: ``prompt`` prompt tokens, then per turn (glue tokens, versions, reward)."""
    input_ids, mask, logprobs, versions, spans = [], [], [], [], []
    input_ids += [1] * prompt
    mask += [0] * prompt
    logprobs += [0.0] * prompt
    versions += [-1] * prompt
    for glue, turn_versions, reward in turns:
        input_ids += [2] * glue
        mask += [0] * glue
        logprobs += [0.0] * glue
        versions += [-1] * glue
        start = len(input_ids)
        input_ids += [3] * len(turn_versions)
        mask += [1] * len(turn_versions)
        logprobs += [-0.5] * len(turn_versions)
        versions += turn_versions
        spans.append(
            {"completion_id": f"c{start}", "start": start, "end": len(input_ids), "reward": reward}
        )
    return {
        "row_index": row_index,
        "input_ids": input_ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "versions": versions,
        "turns": spans,
    }


def session(sid: str, reward: float | None, rows: list[dict], group: str | None = "g"):
    return {
        "session_id": sid,
        "task_id": "t",
        "group_id": group,
        "metadata": {},
        "reward": reward,
        "rows": rows,
    }


def batch(sessions, **kwargs):
    options = dict(
        policy_version=5,
        max_staleness=1,
        stale="mask",
        estimator="grpo",
        discount=1.0,
        baseline=None,
    )
    return build_batch(sessions, **{**options, **kwargs})


def test_grpo_advantage_lands_on_the_turn_tokens_only():
    sessions = [
        session("a", 1.0, [row(3, [(0, [5, 5], None)])]),
        session("b", 0.0, [row(3, [(0, [5, 5, 5], None)])]),
    ]
    out = batch(sessions)
    assert [s.session_id for s in out.samples] == ["a", "b"]
    a, b = out.samples
    assert a.advantages == pytest.approx([0, 0, 0, 1, 1], abs=1e-5)  # (1 - 0.5) / 0.5
    assert b.advantages == pytest.approx([0, 0, 0, -1, -1, -1], abs=1e-5)
    assert out.rewards == [1.0, 0.0]
    assert out.staleness == [0] * 5


def test_per_turn_rewards_are_discounted_over_a_multi_turn_row():
    multi = row(2, [(0, [5], 0.5), (2, [5, 5], None)])  # turn rewards 0.5, then the session's 1
    single = row(2, [(0, [5], None)])
    sessions = [session("m", 1.0, [multi]), session("s", 0.0, [single])]
    out = batch(sessions, estimator="dr_grpo", discount=0.5)
    m = out.samples[0]
    # returns: G1 = 1.0, G0 = 0.5 + 0.5 * 1.0 = 1.0; group mean of G0 = (1.0 + 0.0) / 2 = 0.5
    spans = multi["turns"]
    assert m.advantages[spans[0]["start"]] == pytest.approx(0.5)
    assert m.advantages[spans[1]["start"] : spans[1]["end"]] == pytest.approx([0.5, 0.5])
    assert m.advantages[spans[0]["end"] : spans[1]["start"]] == [0.0, 0.0]  # glue: no loss


def test_turns_of_a_session_split_over_rows_keep_their_order():
    rows = [row(2, [(0, [5], 1.0)], 0), row(4, [(0, [5, 5], None)], 1)]
    out = batch(
        [session("x", 0.0, rows, group=None)],
        estimator="running",
        baseline=RunningBaseline(0.5),
        discount=1.0,
    )
    first, second = out.samples
    # running baseline with no history: the batch mean of the key's scores (G0 = 1.0)
    assert first.advantages[2] == pytest.approx(0.0)  # G0 - 1.0
    assert second.advantages[4:] == pytest.approx([-1.0, -1.0])  # G1 = 0.0


def test_stale_tokens_are_masked_and_counted():
    sessions = [
        session("a", 1.0, [row(1, [(0, [2, 3, 4, 5], None)])]),
        session("b", 0.0, [row(1, [(0, [5], None)])]),
    ]
    out = batch(sessions, policy_version=5, max_staleness=2)  # versions below 3 are stale
    a = out.samples[0]
    assert a.loss_mask == [0, 0, 1, 1, 1]
    assert out.stale_tokens == 1
    assert sorted(out.staleness) == [0, 0, 1, 2]
    # fresh: loss tokens the step's own starting policy (version 5) sampled
    assert a.fresh == [0, 0, 0, 0, 1]
    assert out.samples[1].fresh == [0, 1]


def test_stale_sessions_are_dropped_in_drop_mode():
    sessions = [
        session("a", 1.0, [row(1, [(0, [2, 5], None)])]),
        session("b", 0.0, [row(1, [(0, [5], None)])]),
    ]
    out = batch(sessions, policy_version=5, max_staleness=1, stale="drop")
    assert [s.session_id for s in out.samples] == ["b"]
    assert out.dropped_sessions == 1 and out.sessions == 2


def test_a_row_with_nothing_left_to_train_is_left_out():
    sessions = [
        session("a", 1.0, [row(1, [(0, [0, 0], None)])]),
        session("b", 0.0, [row(1, [(0, [5], None)])]),
    ]
    out = batch(sessions, policy_version=5, max_staleness=1)
    assert [s.session_id for s in out.samples] == ["b"]
    assert out.stale_tokens == 2


def test_checkpoints_and_the_claim_journal(tmp_path):
    store = Checkpoints(tmp_path, keep=2)
    assert store.latest() is None
    store.journal_claim("c1", 0)
    store.journal_claim("c2", 1)
    assert store.journalled() == ["c1", "c2"]
    for step in (1, 2, 3):
        path = store.path(step)
        path.mkdir(parents=True)
        store.commit(path, TrainerState(step=step, version=step + 1, covered_claims=[f"c{step}"]))
    store.path(4).mkdir()  # a checkpoint that crashed half-way is not "latest"
    path, state = store.latest()
    assert state.step == 3 and state.version == 4 and state.covered_claims == ["c3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000003",
        "step-000004",
    ]
    store.clear_journal()
    assert store.journalled() == []
