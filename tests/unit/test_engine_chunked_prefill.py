"""Chunked prefill: a prompt goes through the model a chunk at a time and computes what one
forward over the whole prompt computes, for every architecture in tests/architectures.py.

Each chunk attends to the KV cache so far and itself through a ``chunk x length`` mask; the
logits of every prompt position (read chunk by chunk) must equal a float64 teacher-forced
forward of the checkpoint's model (``tests.architectures.reference_logprobs``) within
``TOLERANCE``, as the one-shot prefill's do. The chunk sizes cut the prompt across the sliding
windows (8 positions) at odd places, so a chunk whose mask forgot the window, the cache's
earlier positions or the causal order would be off by whole nats.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.engine import protocol
from server.engine.runner import ModelRunner, PrefillCancelled, RunnerConfig
from server.engine.service import EngineService
from server.engine.settings import EngineSettings
from tests import architectures

TOLERANCE = 1e-4  # nats, float32 against float64 (as tests/unit/test_architectures_engine.py)
PROMPT = 45
CHUNKS = (5, 16, PROMPT)  # PROMPT: one chunk, the prefill as it was


def prompt(length: int = PROMPT, seed: int = 0) -> list[int]:
    return torch.randint(3, 680, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunked_logprobs(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logprob of each prompt token after the first, from the prefill's chunked logits, and the
    query lengths of the masks the runner built."""
    chunks: list[tuple[int, torch.Tensor]] = []
    queries: list[int] = []
    masks = runner._masks

    def recording(positions: torch.Tensor, kv_len: int):
        queries.append(positions.shape[1])
        return masks(positions, kv_len)

    runner._masks = recording  # type: ignore[method-assign]
    try:
        last = runner.prefill(
            0, ids, on_logits=lambda start, logits: chunks.append((start, logits))
        )
    finally:
        del runner._masks
    assert [start for start, _ in chunks] == list(range(0, len(ids), runner.config.prefill_chunk))
    logits = torch.cat([chunk for _, chunk in chunks]).double()
    assert torch.equal(last, chunks[-1][1][-1:])
    targets = torch.tensor(ids[1:])
    logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, targets[:, None])[:, 0]
    return logprobs, queries


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_chunked_prefill_equals_the_checkpoints_model(name, model_dirs):
    ids = prompt()
    expected = architectures.reference_logprobs(model_dirs[name], ids)
    worst = {}
    for chunk in CHUNKS:
        runner = ModelRunner(RunnerConfig(model_dirs[name], max_slots=1, prefill_chunk=chunk))
        logprobs, queries = chunked_logprobs(runner, ids)
        assert max(queries) == min(chunk, PROMPT)  # no mask is prompt x prompt
        worst[chunk] = (logprobs - expected).abs().max().item()
    print(f"{name}: max |chunked - float64 reference| by chunk size: {worst}")
    assert max(worst.values()) <= TOLERANCE


def test_the_test_would_catch_a_chunk_that_forgot_the_cache(model_dirs, monkeypatch):
    """Sensitivity: a chunk attending only to itself (its mask blind to earlier positions) is
    off by far more than the tolerance."""
    name = "llama"
    runner = ModelRunner(RunnerConfig(model_dirs[name], max_slots=1, prefill_chunk=5))
    masks = runner._masks

    def blind(positions: torch.Tensor, kv_len: int):
        mask = masks(positions, kv_len)
        start = int(positions[0, 0])
        mask[..., :start] = torch.finfo(mask.dtype).min
        return mask

    monkeypatch.setattr(runner, "_masks", blind)
    chunks: list[torch.Tensor] = []
    runner.prefill(0, prompt(), on_logits=lambda _start, logits: chunks.append(logits))
    ids = prompt()
    logits = torch.cat(chunks).double()
    logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    expected = architectures.reference_logprobs(model_dirs[name], ids)
    assert (logprobs - expected).abs().max().item() > 100 * TOLERANCE


def _generate(service: EngineService, ids: list[int]) -> dict:
    request = protocol.GenerateRequestIn(
        input_ids=ids,
        sampling_params={"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        token_ids_logprob=[5, 17],
    )
    items, _ = service.parse(request)
    return asyncio.run(service.generate(request, items))[0]


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # fast decode; eager, soft-capped, windowed
def test_served_prompt_and_output_logprobs_do_not_depend_on_the_chunk(name, model_dirs):
    """Through the real EngineService: prompt logprobs (taken chunk by chunk), their top-k and
    by-id lists, and the sampled tokens and their logprobs, for chunk sizes 5 and the prompt."""
    ids = prompt(seed=1)
    served = {}
    for chunk in (5, PROMPT):
        service = EngineService(
            EngineSettings(model=model_dirs[name], device="cpu", seed=3, prefill_chunk=chunk)
        )
        service.scheduler.start()
        try:
            served[chunk] = _generate(service, ids)["meta_info"]
        finally:
            service.close()
    chunked, whole = served[5], served[PROMPT]
    assert len(chunked["input_token_logprobs"]) == PROMPT
    assert chunked["input_token_logprobs"][0][0] is None  # position 0 has none
    expected = architectures.reference_logprobs(model_dirs[name], ids)
    got = torch.tensor([entry[0] for entry in chunked["input_token_logprobs"][1:]]).double()
    assert (got - expected).abs().max().item() <= TOLERANCE
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert len(chunked[key]) == len(whole[key]) == PROMPT
        for a, b in zip(chunked[key][1:], whole[key][1:], strict=True):
            a_values = torch.tensor([a[0]] if key == "input_token_logprobs" else [e[0] for e in a])
            b_values = torch.tensor([b[0]] if key == "input_token_logprobs" else [e[0] for e in b])
            assert (a_values - b_values).abs().max().item() <= TOLERANCE
    tokens = [entry[1] for entry in chunked["output_token_logprobs"]]
    assert tokens == [entry[1] for entry in whole["output_token_logprobs"]]
    outputs = torch.tensor([entry[0] for entry in chunked["output_token_logprobs"]]).double()
    reference = architectures.reference_logprobs(model_dirs[name], ids + tokens)[PROMPT - 1 :]
    assert (outputs - reference).abs().max().item() <= TOLERANCE


def test_a_prefill_stops_between_chunks_when_asked(tiny_model_dir):
    runner = ModelRunner(RunnerConfig(str(tiny_model_dir), max_slots=1, prefill_chunk=16))
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(PrefillCancelled, match="prefill stopped at token 32 of 100"):
        runner.prefill(0, list(range(3, 103)), cancelled=cancelled)


def test_the_cache_holds_the_slots_in_use_not_every_slot(tiny_model_dir):
    """One long prompt grows one slot's worth of positions, not max_slots x positions, and the
    cache shrinks back once nothing that long runs."""
    runner = ModelRunner(
        RunnerConfig(str(tiny_model_dir), max_slots=64, context_length=2048, prefill_chunk=256)
    )
    cache = runner.cache
    small = cache.memory_bytes()
    runner.prefill(0, prompt(1500))
    assert cache.capacity >= 1500 and cache.slots == 4
    per_position = small / (cache.initial_slots * cache.initial_capacity)
    assert cache.memory_bytes() == per_position * cache.slots * cache.capacity
    assert cache.memory_bytes() < 64 * 1500 * per_position / 10
    cache.reserve(10, 5)  # five slots in use: twice the 4 there were, not max_slots
    assert cache.slots == 8
    cache.fit(5, 1500)  # still needed: kept
    assert cache.slots == 8
    cache.reserve(10, 17)
    assert cache.slots == 17
    kept = cache.keys[0][0, :, :1500].clone()
    cache.fit(1, 1500)  # 1 slot of 1500: shrinks the slots, keeps what slot 0 holds
    assert cache.slots == 4 and torch.equal(cache.keys[0][0, :, :1500], kept)
    cache.fit(0, 0)
    assert (cache.slots, cache.capacity) == (4, 256) and cache.memory_bytes() == small
