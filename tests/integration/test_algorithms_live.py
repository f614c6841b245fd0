"""Every objective, loss option, advantage estimator and reward option of issue 28 trains live.

`proxrl train` runs 2 steps against one shared `proxrl serve` (tiny model, embedded engine,
SQLite) per combination below, each in a run of its own. A trainer's start (Ray, the workers,
the model) is most of a run's time, so each run takes one example config of examples/algorithms/
as its base and adds the options of others that fit with it: six runs train every entry (the
default `ppo` objective and `grpo` estimator train in every other live test). Every example file
loads (tests/unit/test_objectives_examples.py, tests/unit/test_advantages_matrix.py).

What it shows: each option reaches the loss or the advantages through the real trainer (Ray,
FSDP2, the algorithm/backend split), the steps publish, the figures stay finite with a nonzero
gradient, and each option's own figure moves as it should (the reward scale's returns, the
entropy, the reference KL, the overlong penalty). What it does not: that an option learns (the
numerics are the unit tests' business, against each paper's definition). DAPO's overlong
filter runs end to end in the last test: the server records that the length limit cut an
answer, the claim carries it, the trainer masks it and drops a session left with nothing.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support import ProxyProcess
from tests.trainer_runs import Server, finish, kill, metrics, start_trainer
from trainer.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLES = Path(__file__).parents[2] / "examples" / "algorithms"
GROUPS = 4  # two steps of 8 sessions, groups of 4 (one claim may take them all)
ANSWER_TOKENS = 8
# base example -> the options of other examples it also trains (their files named beside)
RUNS = {
    "gspo": ["algorithm.advantage=lite_ppo"],  # lite_ppo.yaml
    "sapo": [
        "algorithm.entropy_coef=0.001",  # entropy_bonus.yaml
        "algorithm.advantage=dr_grpo",  # reward_shaping.yaml
        "algorithm.reward_scale=0.5",
        "algorithm.reward_clip=1.0",
    ],
    "m2po": [
        "algorithm.kl_coef=0.05",  # kl_k2.yaml
        "algorithm.kl_estimator=k2",
        "algorithm.advantage_std=sample",  # grpo_sample_std.yaml
    ],
    "dr_grpo": [  # the constant aggregation
        "algorithm.advantage=reinforce_pp_baseline",  # reinforce_pp_baseline.yaml
        # dapo_overlong_penalty.yaml, its window set to the answers' length here, so that each
        # full-length answer is punished (-1 at L_max)
        f"algorithm.overlong_max_tokens={ANSWER_TOKENS}",
        "algorithm.overlong_cache_tokens=4",
    ],
    "reinforce_pp_kl_reward": [],  # the KL to the reference in the reward (REINFORCE++)
    "ppo_critic": [],  # a value head and GAE (the worker's head, the driver's token rewards)
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("server")) as proxy:
        yield Server(proxy)


def feed(server: Server, run_id: str, group_size: int) -> list[str]:
    """``GROUPS`` groups of sessions in ``run_id``, rewards 0 and 1 in each (contrast)."""
    sessions = []
    for group in range(GROUPS):
        for member in range(group_size):
            created = server.proxy.session(run_id=run_id, group_id=f"{run_id}-g{group}")
            client = OpenAI(base_url=created["base_url"], api_key=created["api_key"])
            client.chat.completions.create(
                model=server.proxy_model,
                messages=[{"role": "user", "content": "Count."}],
                max_tokens=ANSWER_TOKENS,
                temperature=1.0,
            )
            server.reward(created["session_id"], float(member % 2))
            server.end(created["session_id"])
            sessions.append(created["session_id"])
    return sessions


def new_run(server: Server, name: str) -> str:
    reply = server.http.post("/rl/runs", json={"name": name})
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


@pytest.mark.parametrize("base", list(RUNS))
def test_every_option_trains_two_steps_live(base, server, tmp_path):
    path = EXAMPLES / f"{base}.yaml"
    overrides = RUNS[base]
    config = load_config(path, ["server=http://127.0.0.1:9", *overrides])
    run_id = new_run(server, f"live-{base}")
    feed(server, run_id, config.algorithm.group_size or 1)
    out = tmp_path / "train"
    args = ["--config", str(path), f"run_id={run_id}", "max_steps=2", *overrides]
    finish(start_trainer(server, out, *args))
    steps = metrics(out)
    assert [s["version"] for s in steps] == [1, 2]
    algo = config.algorithm
    for step in steps:
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0, step
        assert step["sessions"] == config.batch_size
        assert 0 <= step["second_moment_masked_fraction"] <= 1, step
        assert step["clipped_sequences"] >= 0, step
        if algo.reward_clip is not None:  # rewards 0 and 1, scaled then clipped, reach returns
            want = min(algo.reward_scale, algo.reward_clip) * step["reward_mean"]
            assert abs(step["return_mean"] - want) <= 1e-12, step
        if algo.overlong_max_tokens is not None:  # each answer of L_max tokens gets -1 or so
            assert step["return_mean"] < step["reward_mean"], step
        if algo.kl_coef > 0 and not algo.kl_in_reward:
            assert math.isfinite(step["reference_kl"]), step
        if algo.entropy_coef > 0:
            assert step["entropy"] > 0, step
        if algo.critic:  # the value head trains beside the policy
            assert math.isfinite(step["value_loss"]) and step["value_loss"] > 0, step


def test_overlong_filter_masks_cut_answers_live(server, tmp_path):
    path = EXAMPLES / "dapo_overlong.yaml"
    run_id = new_run(server, "live-overlong-filter")
    group_size = load_config(path, ["server=http://127.0.0.1:9"]).algorithm.group_size or 1
    sessions = feed(server, run_id, group_size)
    cut = [
        s
        for s in sessions
        if all(
            turn["finish_reason"] == "length"
            for row in server.get(s)["rows"]
            for turn in row["turns"]
        )
    ]
    assert cut, "no answer was cut at max_tokens: the test needs some"
    out = tmp_path / "train"
    process = start_trainer(server, out, "--config", str(path), f"run_id={run_id}")
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.log_path.read_text()[-3000:]
            reasons = {s: server.get(s).get("drop_reason") for s in cut}
            if all(reasons.values()):
                break
            assert time.monotonic() < deadline, reasons
            time.sleep(0.5)
    finally:
        kill(process)
    for reason in reasons.values():
        assert reason.startswith("no_trainable_tokens"), reason
        assert "cut by the length limit (overlong_filter)" in reason, reason
