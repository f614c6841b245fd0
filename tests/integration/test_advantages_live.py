"""Every advantage estimator and reward option added for issue 28 trains live: `proxrl train`
with each of their example configs of examples/algorithms/ (lite_ppo, reinforce_pp_baseline,
the sample std, reward scale and clip, DAPO's soft overlong penalty), 2 steps against one
shared `proxrl serve` (tiny model, embedded engine, SQLite), each in a run of its own; and
DAPO's overlong filter end to end: the server records that the length limit cut an answer, the
claim carries it, the trainer masks it and drops a session left with nothing, saying why.

What it does not show: that an estimator learns (the numerics are
tests/unit/test_advantages_matrix.py's business, against each paper's definition).
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
# name -> overrides: the soft penalty's window is set to the answers' length here, so each
# full-length answer is punished (-1 at L_max)
ENTRIES = {
    "lite_ppo": [],
    "reinforce_pp_baseline": [],
    "grpo_sample_std": [],
    "reward_shaping": [],
    "dapo_overlong_penalty": [
        f"algorithm.overlong_max_tokens={ANSWER_TOKENS}",
        "algorithm.overlong_cache_tokens=4",
    ],
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


@pytest.mark.parametrize("name", list(ENTRIES))
def test_each_estimator_and_reward_option_trains_two_steps_live(name, server, tmp_path):
    path = EXAMPLES / f"{name}.yaml"
    overrides = ENTRIES[name]
    config = load_config(path, ["server=http://127.0.0.1:9", *overrides])
    run_id = new_run(server, f"live-{name}")
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
        if algo.reward_clip is not None:  # rewards 0 and 1, scaled then clipped, reach returns
            want = min(algo.reward_scale, algo.reward_clip) * step["reward_mean"]
            assert abs(step["return_mean"] - want) <= 1e-12, step
        if algo.overlong_max_tokens is not None:  # each answer of L_max tokens gets -1 or so
            assert step["return_mean"] < step["reward_mean"], step


def test_overlong_filter_masks_cut_answers_live(server, tmp_path):
    path = EXAMPLES / "dapo_overlong.yaml"
    run_id = new_run(server, "live-overlong-filter")
    sessions = feed(
        server, run_id, load_config(path, ["server=http://127.0.0.1:9"]).algorithm.group_size or 1
    )
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
