"""A weight swap in the middle of streaming requests: nobody notices but the version spans."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from tests.support import ProxyProcess, teacher_forced_logprobs

LOGPROB_TOLERANCE = 1e-4
STREAMS = 20


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """The tiny model (version 0) and a perturbed copy to publish as version 1."""
    v1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    v2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in v2.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    v2_dir = tmp_path_factory.mktemp("models") / "tiny-v2"
    v2.save_pretrained(v2_dir)
    return {0: v1, 1: v2, "v2_dir": v2_dir}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("proxy")) as process:
        yield process


async def _stream(session: dict, progress: dict, index: int) -> dict:
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Count with me, number {index}."}],
        max_tokens=150,
        stream=True,
    )
    text, finish = "", None
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        progress[index] = progress.get(index, 0) + 1
    await client.close()
    return {"text": text, "finish_reason": finish}


def test_weight_swap_mid_stream(proxy, models):
    sessions = [proxy.session(task_id="swap") for _ in range(STREAMS)]

    async def run():
        progress: dict[int, int] = {}
        streams = [asyncio.create_task(_stream(s, progress, i)) for i, s in enumerate(sessions)]
        deadline = time.monotonic() + 60
        while len(progress) < STREAMS or min(progress.values()) < 5:
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(timeout=120) as http:
            swap = await http.post(
                f"{proxy.url}/admin/weights",
                json={"model_path": str(models["v2_dir"])},
                headers=proxy.admin,
            )
        return swap, await asyncio.gather(*streams)

    swap, results = asyncio.run(run())
    assert swap.status_code == 200, swap.text
    assert swap.json()["policy_version"] == 1
    spanning = 0
    for session, result in zip(sessions, results, strict=True):
        (turn,) = proxy.get_session(session["session_id"])["turns"]
        # One uninterrupted answer: what was streamed is what was stored, and it ended normally.
        assert result["finish_reason"] in ("stop", "length")
        assert result["text"] == turn["response"]["content"]
        assert turn["finish_reason"] == result["finish_reason"]
        versions = turn["versions"]
        assert len(versions) == len(turn["completion_ids"]) == len(turn["logprobs"])
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        if set(versions) == {0, 1}:
            spanning += 1
            assert turn["resubmits"] >= 1
        _check_logprobs_per_version(models, turn)
    assert spanning >= STREAMS // 2, f"only {spanning} streams lived through the swap"
    run = httpx.get(f"{proxy.url}/rl/runs", headers=proxy.admin).json()
    assert any(r["is_default"] and r["policy_version"] == 1 for r in run)


def _check_logprobs_per_version(models, turn: dict) -> None:
    """Each token's logprob is exact under the weights of the version it is tagged with."""
    prompt, ids, versions = turn["prompt_ids"], turn["completion_ids"], turn["versions"]
    cut = versions.index(1) if 1 in versions else len(ids)
    expected = teacher_forced_logprobs(models[0], prompt, ids[:cut], 1.0)
    if cut < len(ids):
        expected += teacher_forced_logprobs(models[1], prompt + ids[:cut], ids[cut:], 1.0)
    error = max(abs(a - b) for a, b in zip(turn["logprobs"], expected, strict=True))
    assert error < LOGPROB_TOLERANCE
