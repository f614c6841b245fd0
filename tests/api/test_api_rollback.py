"""POST /rl/runs/{id}/rollback and GET /rl/runs/{id}/versions on the in-process app with an
engine of its own: a rollback publishes the earlier version's weights as the run's next version
(parent the version current until then, source the one rolled back to), served exactly as that
version was (greedy logprobs equal, bit for bit, on the same prompt); a LoRA run's adapter under
the new name, a full-weight run's weights swapped in; version 0 the base. Every refusal in the
REST error shape, and a publish under a number the rollback took refused with the run unchanged.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.rl import rollback as rollback_module
from tests.api.api_support import Api, assert_error
from tests.api.conftest import app_with_own_engine
from tests.integration.test_lora_runs import make_adapter

PROMPT = "Tell me a number."


def perturbed(base_dir: Path, out_dir: Path, seed: int) -> str:
    """The model with every weight moved a little: full weights a trainer could publish."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(out_dir)
    return str(out_dir)


def greedy(api: Api, run_id: str) -> tuple[list[int], list[float], list[int]]:
    """A greedy answer of the run to PROMPT, as stored: its tokens, their logprobs and the
    versions that sampled them."""
    session = api.new_session(run_id)
    api.chat(session, PROMPT, max_tokens=8, temperature=0.0)
    turn = api.session(session["session_id"])["turns"][-1]
    return turn["completion_ids"], turn["logprobs"], turn["versions"]


def publish(api: Api, run_id: str, **source):
    return api.call("POST", "/admin/weights", json={"run_id": run_id, **source})


def rollback(api: Api, run_id: str, version: object):
    return api.call("POST", f"/rl/runs/{run_id}/rollback", json={"version": version})


def lineage(api: Api, run_id: str) -> dict[int, dict]:
    return {row["version"]: row for row in api.ok("GET", f"/rl/runs/{run_id}/versions")}


def engine_adapters(api: Api) -> set[str]:
    (engine,) = api.ok("GET", "/admin/engines")
    cards = httpx.get(f"{engine['url']}/v1/models", timeout=30).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


@pytest.fixture(scope="module")
def own(tiny_model_dir, tmp_path_factory):
    """A factory of apps, each on an engine of its own (a LoRA run and a full-weight run cannot
    share engines)."""
    return lambda name: app_with_own_engine(tiny_model_dir, tmp_path_factory.mktemp(name))


def test_a_lora_run_rolled_back_serves_the_earlier_adapter_under_a_new_name(
    own, tiny_model_dir, tmp_path
):
    with own("rollback-lora") as (api, _):
        run = api.new_run()["id"]
        base = greedy(api, run)
        adapters = [make_adapter(tiny_model_dir, tmp_path / f"a{v}", v) for v in (1, 2, 3)]
        served = {}
        for version, path in enumerate(adapters, 1):
            answer = api.ok("POST", "/admin/weights", json={"run_id": run, "adapter_path": path})
            assert answer["policy_version"] == version
            served[version] = greedy(api, run)
        assert served[1][1] != served[3][1]

        answer = rollback(api, run, 1)
        assert answer.status_code == 200, answer.text
        assert answer.json()["policy_version"] == 4 and answer.json()["pause_seconds"] == 0
        ids, logprobs, versions = greedy(api, run)
        assert (ids, logprobs) == served[1][:2]  # exactly version 1's
        assert set(versions) == {4}
        assert f"{run}@4" in engine_adapters(api)
        rows = lineage(api, run)
        assert [rows[v]["parent"] for v in (1, 2, 3, 4)] == [0, 1, 2, 3]
        assert rows[4]["source"] == 1 and rows[4]["path"] == adapters[0]
        assert [v for v, row in rows.items() if row["current"]] == [4]
        assert all(rows[v]["source"] is None for v in (1, 2, 3))
        assert api.ok("GET", f"/rl/runs/{run}")["rollbacks"] == [[1, 4]]

        # A trainer that has not seen the rollback publishes the number after its own: refused.
        for number in (4, 3):
            reply = publish(api, run, adapter_path=adapters[2], version=number)
            assert_error(reply, 409, code="version_superseded")
        assert api.ok("GET", f"/rl/runs/{run}")["policy_version"] == 4
        assert greedy(api, run)[:2] == served[1][:2]
        again = publish(api, run, adapter_path=adapters[0], version=4)  # the rollback's retry
        assert again.status_code == 200, again.text

        for version, code in ((4, "rollback_refused"), (7, "rollback_refused")):
            assert_error(rollback(api, run, version), 409, code=code)
        shutil.rmtree(adapters[1])  # the trainer's keep_versions pruned version 2
        error = assert_error(rollback(api, run, 2), 410, code="version_evicted")
        assert "gone" in error["message"] and error["param"] == "version"
        assert lineage(api, run)[2]["evicted_reason"] == "files_gone"
        assert_error(rollback(api, run, 2), 410, code="version_evicted")  # marked: cheap now

        answer = rollback(api, run, 0)
        assert answer.status_code == 200 and answer.json()["policy_version"] == 5, answer.text
        assert greedy(api, run)[:2] == base[:2]  # the base model, no adapter
        rows = lineage(api, run)
        assert (rows[5]["parent"], rows[5]["source"], rows[5]["path"]) == (4, 0, None)
        assert api.ok("GET", f"/rl/runs/{run}")["rollbacks"] == [[1, 4], [0, 5]]
        answer = rollback(api, run, 3)  # from the base to an adapter again
        assert answer.status_code == 200 and answer.json()["policy_version"] == 6, answer.text
        assert greedy(api, run)[:2] == served[3][:2]


def test_refusals_in_the_rest_shape(own, tiny_model_dir, tmp_path):
    with own("rollback-refusals") as (api, _):
        run = api.new_run()
        adapter = make_adapter(tiny_model_dir, tmp_path / "a", 5)
        publish(api, run["id"], adapter_path=adapter, version=2)  # version 1 never published
        assert_error(rollback(api, run["id"], 1), 404, code="version_not_found")
        assert_error(rollback(api, "no-such-run", 0), 404, code="run_not_found")
        for bad in (-1, "1", None, 1.5):
            assert_error(rollback(api, run["id"], bad), 422)
        assert_error(api.call("POST", f"/rl/runs/{run['id']}/rollback", json={}), 422)
        reply = api.call(
            "POST", f"/rl/runs/{run['id']}/rollback", key=run["api_key"], json={"version": 0}
        )
        assert_error(reply, 403)
        assert_error(api.call("GET", "/rl/runs/no-such-run/versions"), 404, code="run_not_found")
        assert api.ok("GET", f"/rl/runs/{run['id']}/versions", key=run["api_key"])
        pool = api.http.app.state.ctx.pool  # type: ignore[attr-defined]
        for engine in pool.engines:  # back at the next health check
            pool.mark_down(engine, "taken out by the test")
        assert_error(rollback(api, run["id"], 0), 503)
        assert api.ok("GET", f"/rl/runs/{run['id']}")["policy_version"] == 2


def test_a_full_weight_run_rolled_back_swaps_the_earlier_weights_in(own, tiny_model_dir, tmp_path):
    with own("rollback-full") as (api, _):
        run = api.new_run()["id"]
        base = greedy(api, run)
        weights = [perturbed(tiny_model_dir, tmp_path / f"w{v}", v) for v in (1, 2)]
        served = {}
        for version, path in enumerate(weights, 1):
            assert publish(api, run, model_path=path).json()["policy_version"] == version
            served[version] = greedy(api, run)
        assert served[1][1] != served[2][1]

        answer = rollback(api, run, 1)
        assert answer.status_code == 200, answer.text
        assert answer.json()["policy_version"] == 3
        ids, logprobs, versions = greedy(api, run)
        assert (ids, logprobs) == served[1][:2] and set(versions) == {3}
        rows = lineage(api, run)
        assert (rows[3]["parent"], rows[3]["source"], rows[3]["path"]) == (2, 1, weights[0])
        assert [e["weight_version"] for e in api.ok("GET", "/admin/engines")] == ["3"]

        reply = publish(api, run, model_path=weights[1], version=3)
        assert_error(reply, 409, code="version_superseded")
        assert_error(publish(api, run, model_path=weights[1], version=2), 409)
        assert api.ok("GET", f"/rl/runs/{run}")["policy_version"] == 3
        assert greedy(api, run)[:2] == served[1][:2]

        answer = rollback(api, run, 0)  # the served model (--model)
        assert answer.status_code == 200 and answer.json()["policy_version"] == 4, answer.text
        assert greedy(api, run)[:2] == base[:2]
        after = publish(api, run, model_path=weights[1])  # training goes on from there
        assert after.status_code == 200 and after.json()["policy_version"] == 5, after.text
        assert lineage(api, run)[5]["parent"] == 4


def test_a_publish_that_lands_while_a_rollback_is_prepared_wins_and_the_rollback_is_refused(
    own, tiny_model_dir, tmp_path, monkeypatch
):
    """The trainer's publish of version 4 lands between the rollback's read of the run (at 3)
    and its update lock. Before, the rollback took number 4 too: it overwrote the trainer's
    version (v1's adapter served as run@4, lineage row 4 its own parent) and the trainer, told
    200, never followed. Now the rollback is refused (409 version_superseded) and changes
    nothing."""
    with own("race") as (api, _):
        run = api.new_run()["id"]
        adapters = [make_adapter(tiny_model_dir, tmp_path / f"a{v}", v) for v in (1, 2, 3, 4)]
        for version, path in enumerate(adapters[:3], 1):
            assert publish(api, run, adapter_path=path).json()["policy_version"] == version
        checked = rollback_module._refuse_gone

        async def trainer_publishes_meanwhile(*args, **kwargs):
            reply = await asyncio.to_thread(publish, api, run, adapter_path=adapters[3], version=4)
            assert reply.status_code == 200, reply.text
            return await checked(*args, **kwargs)

        monkeypatch.setattr(rollback_module, "_refuse_gone", trainer_publishes_meanwhile)
        assert_error(rollback(api, run, 1), 409, code="version_superseded")
        rows = lineage(api, run)
        assert (rows[4]["parent"], rows[4]["source"], rows[4]["path"]) == (3, None, adapters[3])
        assert api.ok("GET", f"/rl/runs/{run}")["rollbacks"] == []
        assert set(greedy(api, run)[2]) == {4}
