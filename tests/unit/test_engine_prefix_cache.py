"""The prefix cache: a request that extends a finished one reuses its KV and is served as if cold.

* The index (hypothesis): any sequence of inserts and lookups keeps the bytes held within the
  bound and finds the true longest prefix among the resident entries of the same weights epoch.
* Every architecture of tests/architectures.py: a prompt prefilled after a cached prefix was
  copied into its slot gives the logprobs a float64 teacher-forced forward of the checkpoint's
  model gives (``tests.architectures.reference_logprobs``) within ``TOLERANCE``, as a cold
  prefill does (sliding windows cut at odd places by the reused length and the chunks).
* The real EngineService on the tiny model: the second request of an agent-like session (the
  first's prompt and answer and more) samples the same tokens with the same logprobs (within
  ``TOLERANCE``) warm as cold, the counters say how much was reused, and a weight update
  empties the cache so nothing computed under the old weights is reused (and so does a flush).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine import protocol
from server.engine.prefix_cache import PrefixCache, common_prefix
from server.engine.runner import ModelRunner, RunnerConfig
from server.engine.scheduler import WeightUpdate
from server.engine.service import EngineService
from server.engine.settings import EngineSettings
from tests import architectures

TOLERANCE = 1e-4  # nats, float32 against float64 (as tests/unit/test_architectures_engine.py)

# ----- the index ------------------------------------------------------------------------------

MIN = 3
BYTES_PER_TOKEN = 8 + 4  # an int64 token and one float32 of fake KV


def fake_kv(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(1, n, 1)], [torch.zeros(0, n, 1)]


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=12)
operations = st.lists(
    st.tuples(st.sampled_from(["insert", "lookup"]), tokens, st.integers(0, 1)), max_size=40
)


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(0, 10 * BYTES_PER_TOKEN))
def test_the_index_stays_in_its_bound_and_finds_the_longest_prefix(ops, bound):
    cache = PrefixCache(max_bytes=bound, min_tokens=MIN)
    for op, ids, epoch in ops:
        if op == "insert":
            kept = cache.insert(ids, *fake_kv(len(ids)), epoch=epoch)
            if kept:
                assert any(e.tokens.tolist() == ids for e in cache.entries())
            if len(ids) >= MIN and len(ids) * BYTES_PER_TOKEN <= bound:
                # kept, or an entry of its epoch holds all of it already
                assert any(
                    e.epoch == epoch and e.tokens.tolist()[: len(ids)] == ids
                    for e in cache.entries()
                )
        else:
            query = torch.tensor(ids, dtype=torch.int64)
            lengths = [common_prefix(query, e.tokens) for e in cache.entries() if e.epoch == epoch]
            best = max(lengths, default=0)
            found = cache.lookup(ids, epoch)
            if best < MIN:
                assert found is None
            else:
                assert found is not None
                entry, length = found
                assert length == best and entry.epoch == epoch
                assert entry.tokens.tolist()[:length] == ids[:length]
        held = sum(e.nbytes for e in cache.entries())
        assert cache.nbytes == held <= bound
        assert all(len(e.tokens) >= MIN for e in cache.entries())


def test_lookups_are_counted_and_capped():
    cache = PrefixCache(max_bytes=10_000, min_tokens=4)
    cache.insert(list(range(10)), *fake_kv(10), epoch=0)
    assert cache.lookup(list(range(3)), 0) is None  # shorter than min_tokens
    found = cache.lookup(list(range(10)), 0, limit=9)  # one token left to prefill
    assert found is not None and found[1] == 9
    assert cache.lookup(list(range(10)), 1) is None  # other weights
    assert cache.stats.as_dict() == {
        "hits": 1,
        "misses": 2,
        "reused_tokens": 9,
        "looked_up_tokens": 23,
        "inserted": 1,
        "evicted": 0,
    }


def test_an_entry_that_a_new_one_extends_is_dropped_and_eviction_is_lru():
    per = BYTES_PER_TOKEN
    cache = PrefixCache(max_bytes=20 * per, min_tokens=2)
    cache.insert([1, 2, 3], *fake_kv(3), epoch=0)
    cache.insert([1, 2, 3, 4, 5], *fake_kv(5), epoch=0)  # extends: the first is dropped
    assert [e.tokens.tolist() for e in cache.entries()] == [[1, 2, 3, 4, 5]]
    assert not cache.insert([1, 2, 3], *fake_kv(3), epoch=0)  # held already
    cache.insert([7] * 8, *fake_kv(8), epoch=0)
    cache.lookup([1, 2, 9], 0)  # touches the first
    cache.insert([8] * 9, *fake_kv(9), epoch=0)  # 22 tokens: the least recently used goes
    assert [e.tokens.tolist()[0] for e in cache.entries()] == [1, 8]
    assert cache.stats.evicted == 1
    assert not cache.insert([5] * 21, *fake_kv(21), epoch=0)  # larger than the bound alone


# ----- every architecture: a warm prefill equals the checkpoint's model -----------------------

PROMPT = 45
REUSED = 27  # cuts the 8-token windows and the 16-token chunks at odd places
EXTRA = 23


def random_ids(length: int, seed: int) -> list[int]:
    return torch.randint(3, 680, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(architectures.ARCHITECTURES))
def test_a_prefill_after_a_cached_prefix_equals_the_checkpoints_model(name, model_dirs):
    first = random_ids(PROMPT, seed=0)
    second = first[:REUSED] + random_ids(EXTRA, seed=1)  # shares REUSED tokens, then differs
    runner = ModelRunner(RunnerConfig(model_dirs[name], max_slots=2, prefill_chunk=16))
    cache = PrefixCache(max_bytes=1 << 30, min_tokens=16)
    runner.prefill(0, first)
    assert cache.save(runner.cache, 0, first, epoch=0)
    found = cache.lookup(second, epoch=0, limit=len(second) - 1)
    assert found is not None and found[1] == REUSED
    cache.restore(runner.cache, 1, *found)
    chunks: list[tuple[int, torch.Tensor]] = []
    runner.prefill(1, second, start=REUSED, on_logits=lambda s, lg: chunks.append((s, lg)))
    assert [s for s, _ in chunks] == list(range(REUSED, len(second), 16))  # only the rest ran
    logits = torch.cat([lg for _, lg in chunks]).double()
    targets = torch.tensor(second[REUSED + 1 :])
    got = torch.log_softmax(logits[:-1], -1).gather(-1, targets[:, None])[:, 0]
    expected = architectures.reference_logprobs(model_dirs[name], second)[REUSED:]
    error = (got - expected).abs().max().item()
    print(f"{name}: max |warm prefill - float64 reference| = {error:.2e}")
    assert error <= TOLERANCE


# ----- the real engine on the tiny model --------------------------------------------------------

NEW_TOKENS = 8


def generate(service: EngineService, ids: list[int], seed: int) -> tuple[list[int], torch.Tensor]:
    request = protocol.GenerateRequestIn(
        input_ids=ids,
        sampling_params={
            "max_new_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
        return_logprob=True,
    )
    items, _ = service.parse(request)
    meta = asyncio.run(service.generate(request, items))[0]["meta_info"]
    entries = meta["output_token_logprobs"]
    return [e[1] for e in entries], torch.tensor([e[0] for e in entries], dtype=torch.float64)


def session(model_dir: str, cache_mb: int) -> tuple[list, dict, EngineService]:
    """An agent-like session: a prompt, then that prompt, its answer and a new user turn."""
    service = EngineService(
        EngineSettings(
            model=model_dir,
            device="cpu",
            seed=0,
            prefill_chunk=32,
            prefix_cache_mb=cache_mb,
            prefix_cache_min_tokens=16,
        )
    )
    service.scheduler.start()
    prompt = random_ids(150, seed=2)
    first = generate(service, prompt, seed=5)
    second_prompt = prompt + first[0] + random_ids(40, seed=3)
    second = generate(service, second_prompt, seed=6)
    stats = service.scheduler.prefix_cache.stats.as_dict()
    return [(prompt, first), (second_prompt, second)], stats, service


def test_a_warm_request_samples_what_a_cold_one_does(tiny_model_dir):
    cold, cold_stats, service = session(str(tiny_model_dir), cache_mb=0)
    service.close()
    warm, stats, service = session(str(tiny_model_dir), cache_mb=64)
    try:
        assert cold_stats["hits"] == 0
        # The first request's prompt and all but its last token (never fed back) were reused.
        assert stats["hits"] == 1 and stats["reused_tokens"] == 150 + NEW_TOKENS - 1
        assert service.loads()["loads"][0]["cache_hit_rate"] > 0
        for (prompt, (tokens, logprobs)), (_, (cold_tokens, cold_logprobs)) in zip(
            warm, cold, strict=True
        ):
            assert tokens == cold_tokens
            assert (logprobs - cold_logprobs).abs().max().item() <= TOLERANCE
            expected = architectures.reference_logprobs(str(tiny_model_dir), prompt + tokens)
            assert (logprobs - expected[len(prompt) - 1 :]).abs().max().item() <= TOLERANCE

        # A weight update (the same weights, a new version) empties the cache: the next request
        # that extends the session recomputes everything.
        scheduler = service.scheduler
        assert len(scheduler.prefix_cache) == 1
        state = service.runner.model.state_dict()
        name = next(iter(state))
        update = WeightUpdate({name: state[name].clone()}, "v2", abort_all=False, flush_cache=True)
        assert scheduler.request_update(update).result(timeout=30).success
        assert len(scheduler.prefix_cache) == 0 and scheduler.prefix_cache.nbytes == 0
        prompt, (tokens, _) = warm[1]
        generate(service, prompt + tokens + random_ids(20, seed=4), seed=7)
        assert scheduler.prefix_cache.stats.hits == 1  # a miss: nothing of the old weights
        assert len(scheduler.prefix_cache) == 1  # what the new weights computed is kept
        assert scheduler.call(scheduler.flush_cache).result(timeout=30)  # /flush_cache empties it
        assert len(scheduler.prefix_cache) == 0
    finally:
        service.close()
