"""Every objective and loss option of trainer/objectives/ trains live: `proxrl train` with each
example config of examples/algorithms/ that exercises one (ppo, gspo, sapo, m2po, the sequence
mean and constant aggregations, the entropy bonus, the k2 KL, REINFORCE++'s KL in the reward),
2 steps against one shared `proxrl serve` (tiny model, embedded engine, SQLite), each in a run
of its own.

What it shows: the option reaches the loss through the real trainer (Ray, FSDP2, the
algorithm/backend split), the steps publish, and the figures stay finite with a nonzero
gradient. What it does not: that the objective learns (the numerics are the unit tests'
business, tests/unit/test_objectives*.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support import ProxyProcess
from tests.trainer_runs import Server, finish, metrics, start_trainer
from trainer.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLES = Path(__file__).parents[2] / "examples" / "algorithms"
ENTRIES = [
    "ppo",
    "gspo",
    "sapo",
    "m2po",
    "grpo_sequence_mean",
    "dr_grpo",
    "entropy_bonus",
    "kl_k2",
    "reinforce_pp_kl_reward",
]
GROUPS = 4  # two steps of 8 sessions, groups of 4


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("server")) as proxy:
        yield Server(proxy)


def feed(server: Server, run_id: str, group_size: int) -> None:
    """``GROUPS`` groups of sessions in ``run_id``, rewards 0 and 1 in each (contrast)."""
    for group in range(GROUPS):
        for member in range(group_size):
            created = server.proxy.session(run_id=run_id, group_id=f"{run_id}-g{group}")
            client = OpenAI(base_url=created["base_url"], api_key=created["api_key"])
            client.chat.completions.create(
                model=server.proxy_model,
                messages=[{"role": "user", "content": "Count."}],
                max_tokens=8,
                temperature=1.0,
            )
            server.reward(created["session_id"], float(member % 2))
            server.end(created["session_id"])


@pytest.mark.parametrize("name", ENTRIES)
def test_each_objective_trains_two_steps_live(name, server, tmp_path):
    path = EXAMPLES / f"{name}.yaml"
    config = load_config(path, ["server=http://127.0.0.1:9"])
    reply = server.http.post("/rl/runs", json={"name": f"live-{name}"})
    assert reply.status_code == 201, reply.text
    run_id = reply.json()["id"]
    feed(server, run_id, config.algorithm.group_size or 1)
    out = tmp_path / "train"
    finish(start_trainer(server, out, "--config", str(path), f"run_id={run_id}", "max_steps=2"))
    steps = metrics(out)
    assert [s["version"] for s in steps] == [1, 2]
    for step in steps:
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0, step
        assert step["sessions"] == config.batch_size
        if config.algorithm.kl_coef > 0:
            assert math.isfinite(step["reference_kl"])
        if config.algorithm.entropy_coef > 0:
            assert step["entropy"] > 0
