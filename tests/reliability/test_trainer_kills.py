"""A trainer SIGKILLed at each point of a step, against a live `proxrl serve`: a new trainer
finishes the run and every session trains exactly once, none skipped, none masked as stale
because of the restart; twice, before a republish was checkpointed, too.

Each test drives a real proxy (tiny model, embedded engine, SQLite), agents through the real
openai SDK, and real trainer processes (Ray, FSDP2) stopped at failpoints
(trainer/failpoints.py) and killed there.
"""

from __future__ import annotations

import json

import pytest

from tests.support import ProxyProcess
from tests.trainer_runs import Server, finish, kill_at, metrics, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        yield Server(proxy)


KILL_POINTS = [
    ("claimed", 3),
    ("trained", 3),
    ("published", 3),
    ("checkpoint_saved", 4),
    ("checkpointed", 4),
]


@pytest.mark.parametrize(("point", "step"), KILL_POINTS, ids=[p for p, _ in KILL_POINTS])
def test_a_trainer_killed_at_any_point_trains_every_session_exactly_once(
    server, tmp_path, point, step
):
    """Checkpoints every 2 steps; SIGKILL at ``point`` of ``step``; a new trainer finishes.

    Every session is sampled by version 0 before training starts, and max_staleness (4) lets
    the last of 5 steps train them: so a token masked as stale can only come from the versions
    a restart adds (the republish), which is what the rule must see through."""
    out = tmp_path / "train"
    batch, steps = 4, 5
    sessions = [server.episode(reward=float(i % 2)) for i in range(batch * steps)]
    common = [
        f"batch_size={batch}", f"max_steps={steps}", "checkpoint_every=2",
        f"max_staleness={steps - 1}", "algorithm.stale=mask",  # the rule under test masks
    ]  # fmt: skip
    kill_at(server, out, common, f"{point}@{step}")
    before = metrics(out)
    log = finish(start_trainer(server, out, *common), 500)
    after = metrics(out)[len(before) :]

    # The surviving lineage: run 1's steps up to the checkpoint run 2 resumed from, then run 2.
    resumed_from = after[0]["step"] - 1
    assert resumed_from == (4 if point == "checkpointed" else 2)
    lineage = [s for s in before if s["step"] <= resumed_from] + after
    assert [s["step"] for s in lineage] == list(range(1, steps + 1))
    trained = [s for record in lineage for s in record["session_ids"]]
    assert sorted(trained) == sorted(sessions)  # each once, none lost
    statuses = server.statuses()
    assert {statuses[s] for s in sessions} == {"consumed"}
    assert (out / "claims.jsonl").read_text() == ""
    # none skipped because of the restart itself: not a token masked, not a session dropped
    assert all(r["stale_tokens"] == 0 and r["dropped_sessions"] == 0 for r in lineage)
    # the engines had a version the checkpoint does not hold only after a publish
    assert ("republished the weights of version" in log) == (
        point in ("published", "checkpoint_saved")
    )
    assert server.run["policy_version"] == lineage[-1]["version"]
    print(f"\nkilled at {point}@{step}: {len(sessions)} sessions trained once in 5 steps")


def test_a_second_kill_before_the_republish_is_checkpointed_loses_nothing(server, tmp_path):
    """Killed after publishing step 3 (checkpoint at 2), restarted: the restored weights are
    republished; killed again after publishing step 4, before its checkpoint. The third
    trainer must still know the first republish (from the journal), republish again, and
    train every session exactly once."""
    out = tmp_path / "train"
    batch, steps = 4, 6
    sessions = [server.episode(reward=float(i % 2)) for i in range(batch * steps)]
    common = [
        f"batch_size={batch}", f"max_steps={steps}", "checkpoint_every=2",
        f"max_staleness={steps}", "algorithm.stale=mask",  # the rule under test masks
    ]  # fmt: skip
    records = []
    for pause in ("published@3", "published@4"):
        kill_at(server, out, common, pause)
        records.append(len(metrics(out)))
    log = finish(start_trainer(server, out, *common), 500)
    assert "republished the weights of version 2 as version 7" in log
    state = json.loads((out / "checkpoints" / f"step-{steps:06d}" / "trainer.json").read_text())
    assert state["republished"] == [[2, 4], [2, 7]]
    final = metrics(out)[records[1] :]
    lineage = [r for r in metrics(out)[: records[0]] if r["step"] <= 2] + final
    assert [r["step"] for r in lineage] == list(range(1, steps + 1))
    trained = [s for record in lineage for s in record["session_ids"]]
    assert sorted(trained) == sorted(sessions)
    assert {server.statuses()[s] for s in sessions} == {"consumed"}
    assert all(r["stale_tokens"] == 0 and r["dropped_sessions"] == 0 for r in lineage)
    print(f"\nkilled twice: {len(sessions)} sessions trained once in {steps} steps")
