"""LoRA runs through a live ``proxrl serve`` on its embedded engine: a run's versions are adapters
loaded beside the other runs' on the same engine, each request served with its run's adapter,
each token recorded with the version that sampled it; full weights and adapters refused on the
same engines; the run's older adapters unloaded past ``--adapters-kept``.

The reference for every logprob is a float64 forward of the base model with the adapter merged
(peft's ``merge_and_unload``: W0 + (alpha/r) B A, Hu et al. 2021 eq. 3), teacher-forced on the
tokens the proxy recorded."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.support import ProxyProcess, RestClient, teacher_forced_logprobs
from trainer.config import LoraConfig
from trainer.model import adapter_state, with_lora
from trainer.worker import write_adapter_dir

LOGPROB_TOLERANCE = 1e-4  # float32 engine against the float64 reference
KEPT = 2  # --adapters-kept


def make_adapter(base_dir, out_dir, seed: int) -> str:
    """An adapter as a LoRA run's trainer publishes one (``write_adapter_dir``), with random A
    and (non-zero) B."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    model = with_lora(AutoModelForCausalLM.from_pretrained(base_dir), lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    state = adapter_state(model, model.state_dict())
    write_adapter_dir(state, model.peft_config["default"], Path(base_dir), Path(out_dir))
    return str(out_dir)


def reference(base_dir, adapter_dir: str | None):
    """The float64 model a request of that adapter (None: the base) is sampled from."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64).eval()
    if adapter_dir is None:
        return model
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()


class Client(RestClient):
    def __init__(self, process: ProxyProcess) -> None:
        self.process = process
        self.http = httpx.Client(base_url=process.url, timeout=120)

    def chat(self, session: dict, text: str) -> dict:
        """One turn in the session, as the proxy stored it."""
        reply = self.call(
            "POST",
            "/v1/chat/completions",
            key=session["api_key"],
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 12,
            },
        )
        assert reply.status_code == 200, reply.text
        return self.session(session["session_id"])["turns"][-1]

    def publish(self, run_id: str, **source) -> httpx.Response:
        return self.call("POST", "/admin/weights", json={"run_id": run_id, **source})

    def engine_adapters(self) -> set[str]:
        (engine,) = self.ok("GET", "/admin/engines")
        cards = httpx.get(f"{engine['url']}/v1/models", timeout=30).json()["data"]
        return {card["id"] for card in cards if card.get("parent")}


@pytest.fixture(scope="module")
def lane(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("lora-serve")
    with ProxyProcess(tiny_model_dir, data, "--adapters-kept", str(KEPT)) as process:
        client = Client(process)
        yield client
        client.http.close()


def error_of(model, turn: dict) -> float:
    expected = teacher_forced_logprobs(model, turn["prompt_ids"], turn["completion_ids"], 1.0)
    return max(abs(a - b) for a, b in zip(turn["logprobs"], expected, strict=True))


def test_two_lora_runs_and_the_base_share_one_engine_each_exact(lane, tiny_model_dir, tmp_path):
    run_a, run_b = lane.new_run()["id"], lane.new_run()["id"]
    adapters = {
        "a1": make_adapter(tiny_model_dir, tmp_path / "a1", 1),
        "b1": make_adapter(tiny_model_dir, tmp_path / "b1", 2),
    }
    for run_id, key in ((run_a, "a1"), (run_b, "b1")):
        reply = lane.publish(run_id, adapter_path=adapters[key])
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["policy_version"] == 1 and answer["pause_seconds"] == 0
        assert all(engine["success"] for engine in answer["engines"])
    assert {f"{run_a}@1", f"{run_b}@1"} <= lane.engine_adapters()

    models = {
        "a1": reference(tiny_model_dir, adapters["a1"]),
        "b1": reference(tiny_model_dir, adapters["b1"]),
        None: reference(tiny_model_dir, None),
    }
    served = {"a1": run_a, "b1": run_b, None: None}
    for key, run_id in served.items():
        turn = lane.chat(lane.new_session(run_id), "Tell me a number.")
        assert turn["versions"] == [0 if key is None else 1] * len(turn["completion_ids"])
        assert error_of(models[key], turn) < LOGPROB_TOLERANCE, key
        # and the adapter matters: the other models give these tokens other logprobs
        others = [error_of(models[other], turn) for other in models if other != key]
        assert min(others) > 100 * LOGPROB_TOLERANCE, (key, others)


def test_full_weights_are_refused_beside_adapters_and_bad_adapters_change_nothing(
    lane, tiny_model_dir, tmp_path
):
    run_id = lane.new_run()["id"]
    good = make_adapter(tiny_model_dir, tmp_path / "good", 3)
    assert lane.publish(run_id, adapter_path=good).status_code == 200
    # the default run's full weights would replace the base under the adapters
    reply = lane.publish(lane.ok("GET", "/rl/runs")[0]["id"], model_path=str(tiny_model_dir))
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["code"] == "engines_shared"
    assert "LoRA runs serve their adapters" in reply.json()["error"]["message"]
    # an adapter directory without its weights, and full weights sent as an adapter
    broken = tmp_path / "broken"
    broken.mkdir()
    config = (tmp_path / "good" / "adapter_config.json").read_text()
    (broken / "adapter_config.json").write_text(config)
    for path, says in ((broken, "adapter_model.safetensors"), (tiny_model_dir, "model_path")):
        reply = lane.publish(run_id, adapter_path=str(path))
        assert reply.status_code == 400, reply.text
        assert says in reply.json()["error"]["message"]
    assert lane.ok("GET", f"/rl/runs/{run_id}")["policy_version"] == 1
    session = lane.new_session(run_id)
    turn = lane.chat(session, "Still the first adapter?")
    assert set(turn["versions"]) == {1}
    assert error_of(reference(tiny_model_dir, good), turn) < LOGPROB_TOLERANCE


def test_a_runs_older_adapters_are_unloaded_past_the_kept_versions(lane, tiny_model_dir, tmp_path):
    run_id = lane.new_run()["id"]
    session = lane.new_session(run_id)
    for version in range(1, 5):
        path = make_adapter(tiny_model_dir, tmp_path / f"v{version}", 10 + version)
        reply = lane.publish(run_id, adapter_path=path)
        assert reply.status_code == 200 and reply.json()["policy_version"] == version
        turn = lane.chat(session, f"Version {version}?")
        assert set(turn["versions"]) == {version}
        assert error_of(reference(tiny_model_dir, path), turn) < LOGPROB_TOLERANCE
    deadline = time.monotonic() + 30
    want = {f"{run_id}@{v}" for v in (3, 4)}
    while {name for name in lane.engine_adapters() if name.startswith(run_id)} != want:
        assert time.monotonic() < deadline, lane.engine_adapters()
        time.sleep(0.2)
    # a retry of the last publish (its answer lost) loads nothing and keeps the version
    again = lane.publish(run_id, adapter_path=str(tmp_path / "v4"), version=4)
    assert again.status_code == 200 and again.json()["policy_version"] == 4


def test_a_version_number_loaded_with_other_weights_is_loaded_again(lane, tiny_model_dir, tmp_path):
    """A publish whose load landed but whose record did not leaves ``run@N`` on the engines; a
    publish of N with other weights (the trainer restarted from a checkpoint) must serve those."""
    run_id = lane.new_run()["id"]
    stale = make_adapter(tiny_model_dir, tmp_path / "stale", 21)
    fresh = make_adapter(tiny_model_dir, tmp_path / "fresh", 22)
    (engine,) = lane.ok("GET", "/admin/engines")
    body = {"lora_name": f"{run_id}@1", "lora_path": stale}
    loaded = httpx.post(f"{engine['url']}/load_lora_adapter", json=body, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert lane.publish(run_id, adapter_path=fresh, version=1).status_code == 200
    turn = lane.chat(lane.new_session(run_id), "Which weights?")
    assert set(turn["versions"]) == {1}
    assert error_of(reference(tiny_model_dir, fresh), turn) < LOGPROB_TOLERANCE


def test_runs_times_kept_versions_fit_the_engines_bound(tiny_model_dir, tmp_path):
    """Two runs publishing in turn, each keeping 2 versions on engines that hold 4 adapters: each
    publish makes room by unloading the run's version that falls out before it loads."""
    flags = ("--adapters-kept", "2", "--max-loaded-loras", "4")
    with ProxyProcess(tiny_model_dir, tmp_path / "serve", *flags) as process:
        client = Client(process)
        runs = [client.new_run()["id"], client.new_run()["id"]]
        for version in range(1, 5):
            for index, run_id in enumerate(runs):
                path = make_adapter(tiny_model_dir, tmp_path / f"{index}-{version}", version)
                reply = client.publish(run_id, adapter_path=path)
                assert reply.status_code == 200, reply.text
        want = {f"{run_id}@{version}" for run_id in runs for version in (3, 4)}
        assert client.engine_adapters() == want
        client.http.close()


def test_a_lora_default_run_keeps_its_engine_through_health_rounds_and_a_restart(
    tiny_model_dir, tmp_path
):
    """The default run trained as LoRA: its versions are adapters, so the engines' own weights
    stay at version 0. The pool once expected the default run's adapter version of the engines
    (what a publish of full weights sets), took the engine out of rotation at the next health
    round, and answered every request 503; a restart did the same at once."""
    data = tmp_path / "data"
    (data / "adapters").mkdir(parents=True)
    adapter = make_adapter(tiny_model_dir, data / "adapters" / "v1", seed=11)
    for restart in (False, True):
        with ProxyProcess(tiny_model_dir, data, "--health-interval-s", "0.2") as process:
            client = Client(process)
            if not restart:  # no run_id: the default run's
                published = client.ok("POST", "/admin/weights", json={"adapter_path": adapter})
                assert published["policy_version"] == 1
            time.sleep(1.0)  # five health rounds
            (engine,) = client.ok("GET", "/admin/engines")
            assert engine["healthy"], engine
            session = client.new_session()
            turn = client.chat(session, "one two")
            assert set(turn["versions"]) == {1}, (restart, turn["versions"])
            client.http.close()
