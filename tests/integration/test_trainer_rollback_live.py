"""A live `proxrl train` of a LoRA run follows a rollback of its run (issue 29, part 3).

The trainer trains the default run to version 3 (three steps of two sessions, no checkpoint yet)
and waits for sessions; the test rolls the run back to version 1 (served as version 4) and gives
it more sessions. At its next step the trainer restores version 1's adapter from the files it
published (no checkpoint of version 1: a fresh optimizer state, said in its log), gives back the
claims it trained into versions 2 and 3, checkpoints at once (the checkpoint's adapter equals
version 1's published adapter bit for bit), and publishes version 5 with parent 4; the sessions
given back train again. Along the lineage the run serves (versions 1, 5, 6, 7), every session is
trained exactly once: the steps of those versions trained as many sessions as the run has, all
consumed. (A run of its own, not the default run: requests of a default run trained as LoRA
were answered 503 no_engine_available after its first publish here, a problem of its own.)
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from tests.support import ProxyProcess
from tests.trainer_runs import Server, finish, metrics, start_trainer
from trainer.worker import adapter_file_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TRAINER = (
    "batch_size=2",
    "max_staleness=8",  # every session admitted at once
    "max_steps=6",
    "checkpoint_every=100",  # none before the rollback: the published files are restored
    "lora.rank=4",
    "lora.alpha=8",
    "publish.keep_versions=8",
)


def run_of(server: Server, run_id: str) -> dict:
    return server.http.get(f"/rl/runs/{run_id}").json()


def episode(server: Server, run_id: str, reward: float) -> str:
    """One session of the run: a chat turn, a reward, the end."""
    session_id, client = server.session(run_id=run_id, task_id="t")
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=6
    )
    server.reward(session_id, reward)
    server.end(session_id)
    return session_id


def wait_for_version(server: Server, run_id: str, version: int, trainer) -> None:
    deadline = time.monotonic() + 240
    while run_of(server, run_id)["policy_version"] < version:
        assert trainer.poll() is None, trainer.log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"the run never reached version {version}"
        time.sleep(0.2)


def test_a_trainer_follows_a_rollback_and_trains_each_session_once(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        server = Server(proxy)
        made = server.http.post("/rl/runs", json={"name": "rolled", "config": {}})
        run_id = made.json()["id"]
        first = [episode(server, run_id, float(i % 2)) for i in range(6)]
        out = tmp_path / "trainer"
        trainer = start_trainer(server, out, f"run_id={run_id}", *TRAINER)
        wait_for_version(server, run_id, 3, trainer)
        rolled = server.http.post(f"/rl/runs/{run_id}/rollback", json={"version": 1})
        assert rolled.status_code == 200 and rolled.json()["policy_version"] == 4, rolled.text
        later = [episode(server, run_id, float(i % 2)) for i in range(2)]
        log = finish(trainer)

        assert "restored the weights of version 1 from its published files" in log, log[-3000:]
        assert log.count("trained into a version the rollback discarded") == 2
        versions = {
            row["version"]: row for row in server.http.get(f"/rl/runs/{run_id}/versions").json()
        }
        assert (versions[4]["parent"], versions[4]["source"]) == (3, 1)
        assert versions[5]["parent"] == 4 and versions[5]["source"] is None
        run = run_of(server, run_id)
        assert run["policy_version"] == 7 and run["rollbacks"] == [[1, 4]]

        # The checkpoint the trainer wrote as it followed: version 1's adapter, bit for bit.
        checkpoint = out / "checkpoints" / "step-000003"
        assert '"version": 4' in (checkpoint / "trainer.json").read_text()
        restored = torch.load(checkpoint / "train_state.pt", weights_only=True)["model"]
        published = load_file(out / "weights" / "v000001" / "adapter_model.safetensors")
        assert {adapter_file_name(name) for name in restored} == set(published)
        for name, tensor in restored.items():
            assert torch.equal(tensor, published[adapter_file_name(name)]), name
        trained_on = load_file(out / "weights" / "v000003" / "adapter_model.safetensors")
        assert any(not torch.equal(published[n], trained_on[n]) for n in published)

        steps = {record["version"]: record["sessions"] for record in metrics(out)}
        lineage = {1, 5, 6, 7}
        assert set(steps) == {1, 2, 3, 5, 6, 7}
        assert sum(steps[v] for v in lineage) == len(first + later) == 8
        statuses = server.statuses()
        assert {statuses[s] for s in first + later} == {"consumed"}
