"""Pause modes, weight updates (from disk, and over gloo from a second process), version spans."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.common.weight_transfer import join_group, leave_group
from tests.support import (
    EngineProcess,
    free_port,
    logprob_error,
    stream_events,
    teacher_forced_logprobs,
)

LOGPROB_TOLERANCE = 1e-4
LONG = {"max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def v2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with every weight perturbed: a stand-in for a trained step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    out = tmp_path_factory.mktemp("models") / "tiny-v2"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir, v2_dir):
    return {
        "v1": AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
        "v2": AutoModelForCausalLM.from_pretrained(v2_dir).eval(),
    }


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("logs")) as process:
        yield process


@pytest.fixture(autouse=True)
def original_weights(engine, tiny_model_dir):
    """Every test starts serving the original weights, unpaused, as version "default"."""
    httpx.post(f"{engine.url}/continue_generation", json={})
    reply = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "default"},
        timeout=60,
    )
    assert reply.json()["success"], reply.text


class Streams:
    """Several streaming requests in flight, with their progress visible to the test."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url = client, url
        self.progress: dict[str, int] = {}
        self.tasks: list[asyncio.Task] = []

    def start(self, rid: str, prompt: list[int], params: dict, logprobs: bool = False) -> None:
        body = {"input_ids": prompt, "sampling_params": params, "rid": rid}
        if logprobs:
            body["return_logprob"] = True

        def seen(chunk: dict) -> None:
            self.progress[rid] = len(chunk["output_ids"])

        self.tasks.append(
            asyncio.create_task(stream_events(self.client, f"{self.url}/generate", body, seen))
        )

    async def wait_for_tokens(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.progress) < len(self.tasks) or min(self.progress.values()) < count:
            assert time.monotonic() < deadline, self.progress
            await asyncio.sleep(0.02)

    async def finals(self) -> list[dict]:
        results = await asyncio.gather(*self.tasks)
        for events in results:
            assert events[-1] == "[DONE]"
        return [events[-2] for events in results]


def test_pause_abort_answers_everything_and_holds_new_requests(engine):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            for i in range(4):
                streams.start(f"abort-{i}", [i + 1, 2, 3], LONG)
            await streams.wait_for_tokens(5)
            paused = await client.post(f"{engine.url}/pause_generation", json={"mode": "abort"})
            assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
            finals = await asyncio.wait_for(streams.finals(), timeout=5)
            assert (await client.get(f"{engine.url}/ready")).status_code == 503

            held = asyncio.create_task(
                client.post(
                    f"{engine.url}/generate",
                    json={
                        "input_ids": [1],
                        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                    },
                )
            )
            await asyncio.sleep(1.0)
            assert not held.done()
            loads = (await client.get(f"{engine.url}/v1/loads")).json()["loads"][0]
            assert loads["num_waiting_reqs"] == 1
            await client.post(f"{engine.url}/continue_generation", json={})
            return finals, (await held).json()

    finals, held = asyncio.run(run())
    for final in finals:
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert 5 <= len(final["output_ids"]) < 1500
    assert held["meta_info"]["finish_reason"]["type"] == "length"
    assert len(held["output_ids"]) == 4


def test_retract_resumes_under_new_weights_with_version_spans(engine, v2_dir, models):
    prompts = {"r-0": [1, 2, 3], "r-1": [40, 41], "r-2": list(range(60, 80))}
    params = {"max_new_tokens": 120, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            for rid, prompt in prompts.items():
                streams.start(rid, prompt, params, logprobs=True)
            await streams.wait_for_tokens(10)
            await client.post(f"{engine.url}/pause_generation", json={"mode": "retract"})
            update = await client.post(
                f"{engine.url}/update_weights_from_disk",
                json={"model_path": str(v2_dir), "weight_version": "v2"},
            )
            assert update.status_code == 200, update.text
            assert update.json()["success"] and update.json()["num_paused_requests"] == 0
            info = (await client.get(f"{engine.url}/model_info")).json()
            assert info["weight_version"] == "v2" and info["model_path"] == str(v2_dir)
            await client.post(f"{engine.url}/continue_generation", json={})
            return await streams.finals()

    for (rid, prompt), final in zip(prompts.items(), asyncio.run(run()), strict=True):
        meta = final["meta_info"]
        assert meta["id"] == rid
        assert meta["finish_reason"] == {"type": "length", "length": 120}
        assert meta["num_retractions"] == 1
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "v2"]
        cut = spans[0]["end"]
        assert spans == [
            {"version": "default", "start": 0, "end": cut},
            {"version": "v2", "start": cut, "end": 120},
        ]
        assert 10 <= cut < 120
        assert meta["weight_version"] == "v2"
        ids = final["output_ids"]
        served = [entry[0] for entry in meta["output_token_logprobs"]]
        # Each token's logprob is exact under the weights that produced it.
        before = teacher_forced_logprobs(models["v1"], prompt, ids[:cut], 1.0)
        after = teacher_forced_logprobs(models["v2"], prompt + ids[:cut], ids[cut:], 1.0)
        diffs = [abs(a - b) for a, b in zip(served, before + after, strict=True)]
        assert max(diffs) < LOGPROB_TOLERANCE


def test_in_place_pause_keeps_running_requests_and_refuses_the_flush(engine, v2_dir, models):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            streams.start("ip-0", [9, 9, 9], {"max_new_tokens": 100, "ignore_eos": True}, True)
            streams.start("ip-1", [8, 8], {"max_new_tokens": 100, "ignore_eos": True}, True)
            await streams.wait_for_tokens(10)
            await client.post(f"{engine.url}/pause_generation", json={"mode": "in_place"})
            flush = await client.post(f"{engine.url}/flush_cache")
            assert flush.status_code == 400
            update = await client.post(
                f"{engine.url}/update_weights_from_disk",
                json={"model_path": str(v2_dir), "weight_version": "v2"},
            )
            assert update.status_code == 400
            assert not update.json()["success"]
            assert "cache was not flushed" in update.json()["message"]
            # ...but the weights did change, as in SGLang.
            info = (await client.get(f"{engine.url}/model_info")).json()
            assert info["weight_version"] == "v2"
            await client.post(f"{engine.url}/continue_generation", json={})
            return await streams.finals()

    for final in asyncio.run(run()):
        meta = final["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["num_retractions"] == 0
        assert [s["version"] for s in meta["weight_versions"]] == ["default", "v2"]
        cut = meta["weight_versions"][0]["end"]
        prompt = [9, 9, 9] if meta["id"] == "ip-0" else [8, 8]
        served = [entry[0] for entry in meta["output_token_logprobs"]][:cut]
        expected = teacher_forced_logprobs(models["v1"], prompt, final["output_ids"][:cut], 1.0)
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < LOGPROB_TOLERANCE


def test_update_waits_for_running_requests_and_new_ones_wait_behind_it(engine, v2_dir):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            streams.start("busy", [1, 2], {"max_new_tokens": 300, "ignore_eos": True})
            await streams.wait_for_tokens(3)
            update = asyncio.create_task(
                client.post(
                    f"{engine.url}/update_weights_from_disk",
                    json={"model_path": str(v2_dir), "weight_version": "v2"},
                )
            )
            await asyncio.sleep(0.2)
            behind = asyncio.create_task(
                client.post(
                    f"{engine.url}/generate",
                    json={"input_ids": [3], "sampling_params": {"max_new_tokens": 3}},
                )
            )
            (busy,) = await streams.finals()
            busy_done = time.monotonic()
            reply = await update
            update_done = time.monotonic()
            return busy, busy_done, reply, update_done, (await behind).json()

    busy, busy_done, reply, update_done, behind = asyncio.run(run())
    assert reply.json()["success"]
    assert busy["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert busy["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 300}]
    assert busy_done <= update_done
    assert behind["meta_info"]["weight_version"] == "v2"


def test_update_with_abort_all_cuts_the_wait(engine, v2_dir):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            streams.start("cut", [1, 2], LONG)
            await streams.wait_for_tokens(3)
            reply = await client.post(
                f"{engine.url}/update_weights_from_disk",
                json={"model_path": str(v2_dir), "abort_all_requests": True},
            )
            return reply.json(), await streams.finals()

    reply, (final,) = asyncio.run(run())
    assert reply["success"]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 1500


def test_update_weight_version(engine):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = Streams(client, engine.url)
            streams.start("versioned", [1], LONG)
            await streams.wait_for_tokens(2)
            reply = await client.post(
                f"{engine.url}/update_weight_version", json={"new_version": "step-9"}
            )
            return reply.json(), await streams.finals()

    reply, (aborted,) = asyncio.run(run())
    assert reply == {
        "success": True,
        "message": "Weight version updated to step-9",
        "new_version": "step-9",
    }
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"  # abort_all defaults to true
    out = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
        timeout=30,
    ).json()
    assert out["meta_info"]["weight_version"] == "step-9"
    missing = httpx.post(f"{engine.url}/update_weight_version", json={})
    assert missing.status_code == 400


def test_flush_cache_when_idle(engine):
    for method in ("GET", "POST"):
        reply = httpx.request(method, f"{engine.url}/flush_cache")
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/plain")
        assert reply.text.startswith("Cache flushed.")


def test_bad_weight_updates_are_refused_and_serving_goes_on(engine, tmp_path):
    missing = httpx.post(
        f"{engine.url}/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")}
    )
    assert missing.status_code == 400 and missing.json()["success"] is False
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(7)}, wrong / "model.safetensors")
    mismatch = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": str(wrong)})
    assert mismatch.status_code == 400 and "shape mismatch" in mismatch.json()["message"]
    no_body = httpx.post(f"{engine.url}/update_weights_from_disk", json={})
    assert no_body.status_code == 400 and no_body.json()["object"] == "error"
    info = httpx.get(f"{engine.url}/model_info").json()
    assert info["weight_version"] == "default"


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_distributed_update_over_gloo(engine, v2_dir, models, load_format):
    """The test process is the trainer (rank 0): it forms the group with the engine and
    broadcasts v2's weights; the engine then serves exactly v2."""
    port = free_port()
    state = {name: tensor.contiguous() for name, tensor in models["v2"].state_dict().items()}
    names = list(state)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            joined = asyncio.to_thread(
                join_group, "127.0.0.1", port, 0, 2, "weight_update_group", "gloo"
            )
            init = client.post(
                f"{engine.url}/init_weights_update_group",
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "backend": "gloo",
                },
            )
            group, init_reply = await asyncio.gather(joined, init)
            assert init_reply.json()["success"], init_reply.text
            body = {
                "names": names,
                "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(state[n].shape) for n in names],
                "weight_version": "dist-1",
                "load_format": load_format,
            }
            outside = await client.post(f"{engine.url}/update_weights_from_distributed", json=body)
            assert outside.status_code == 400 and "begin_weight_update" in outside.text
            assert (await client.post(f"{engine.url}/begin_weight_update", json={})).json()[
                "success"
            ]

            def broadcast() -> None:
                if load_format == "flattened_bucket":
                    flat = torch.cat([state[n].flatten() for n in names])
                    torch.distributed.broadcast(flat, group=group, group_src=0)
                else:
                    for name in names:
                        torch.distributed.broadcast(state[name], group=group, group_src=0)

            update, _ = await asyncio.gather(
                client.post(f"{engine.url}/update_weights_from_distributed", json=body),
                asyncio.to_thread(broadcast),
            )
            await client.post(f"{engine.url}/end_weight_update", json={})
            destroyed = await client.post(f"{engine.url}/destroy_weights_update_group", json={})
            await asyncio.to_thread(leave_group, group)
            return update, destroyed

    update, destroyed = asyncio.run(run())
    assert update.status_code == 200 and update.json()["success"], update.text
    assert destroyed.json()["success"]
    assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == "dist-1"
    out = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True},
            "return_logprob": True,
        },
        timeout=30,
    ).json()
    assert logprob_error(models["v2"], [5, 6, 7], out) < LOGPROB_TOLERANCE
    # ...and v2 is far from v1, so the check above tells them apart.
    assert logprob_error(models["v1"], [5, 6, 7], out) > 100 * LOGPROB_TOLERANCE


def test_init_group_errors(engine):
    reply = httpx.post(
        f"{engine.url}/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        },
    )
    assert reply.status_code == 400 and "gloo" in reply.json()["message"]
    missing = httpx.post(
        f"{engine.url}/update_weights_from_distributed",
        json={"names": [], "dtypes": [], "shapes": [], "group_name": "nope"},
    )
    assert missing.status_code == 400
