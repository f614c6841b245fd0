"""A LoRA run's requests through the proxy's generation path, against the SGLang double (SGLang's
adapter registry and answers: docs/architecture/sglang-protocol.md, "LoRA adapters"): each engine
gets the adapter before a request names it, once however many requests wait; a name the engine
holds already (this proxy restarted) counts as loaded; an engine that lost it (it restarted) is
given it again and the request resumed; every token carries the adapter's version; an adapter no
engine can load is a 503, not a 500. And the checks a publish makes of an adapter's files."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.engine_client.adapters import AdapterLoads
from server.engine_client.pool import EnginePool, EngineState
from server.errors import EngineRejected, NoEngineAvailable, WeightsRefused, WeightUpdateFailed
from server.proxy import generation
from server.proxy.generation import SamplingRequest, complete
from server.rl.adapters import load_all
from server.rl.schemas import WeightsIn
from server.rl.weight_files import adapter_problem_of
from server.store.run_adapters import RunAdapters, ServedAdapter
from tests.sglang_double import Adapters, Double, LoRAFlags
from tests.support import free_port
from tests.unit.test_engine_client_lora import ENABLED, Upstream, adapter_dir, serving, sglang


def loads_of(upstream: Upstream) -> list[str]:
    return [body["lora_name"] for path, body in upstream.calls if path == "/load_lora_adapter"]


def test_concurrent_requests_load_an_adapter_once_and_a_known_name_counts_as_loaded(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> tuple[list[str], bool]:
        async with sglang() as (client, _, upstream):
            loads = AdapterLoads()
            await asyncio.gather(*(loads.ensure(client, "run@1", path) for _ in range(8)))
            fresh = AdapterLoads()  # this proxy restarted: the engine holds run@1 already
            await fresh.ensure(client, "run@1", path)
            return loads_of(upstream), fresh.holds(client.url, "run@1")

    loaded, known = asyncio.run(scenario())
    assert loaded == ["run@1"]  # the second load was refused by the double, as SGLang does
    assert known


def test_a_refused_load_is_raised_and_not_remembered(tmp_path):
    async def scenario() -> tuple[EngineRejected | None, bool]:
        async with sglang(LoRAFlags(enabled=False)) as (client, _, _):
            loads = AdapterLoads()
            try:  # an engine started without --enable-lora
                await loads.ensure(client, "run@1", adapter_dir(tmp_path, "a"))
            except EngineRejected as exc:
                return exc, loads.holds(client.url, "run@1")
            return None, loads.holds(client.url, "run@1")

    refused, held = asyncio.run(scenario())
    assert refused is not None and not held


@asynccontextmanager
async def pool_of(url: str) -> AsyncIterator[EnginePool]:
    """A pool of the one engine at ``url``, in rotation (as a health check would find it: the
    double's upstream here serves no health routes)."""
    pool = EnginePool([url])
    engine = pool.engines[0]
    engine.healthy, engine.context_length = True, 128
    try:
        yield pool
    finally:
        await pool.stop()


def _request() -> SamplingRequest:
    return SamplingRequest(prompt_ids=[1, 2, 3], max_tokens=1)


def test_an_engine_that_lost_the_adapter_is_given_it_again_and_tokens_carry_its_version(tmp_path):
    adapter = ServedAdapter("run", 3, adapter_dir(tmp_path, "a"))

    async def scenario():
        upstream = Upstream()
        async with serving(upstream.app()) as engine_url:
            double = Double(engine_url, 1, None, None, ENABLED)
            async with serving(double.app()) as url, pool_of(url) as pool:
                loads = AdapterLoads()
                first = await complete(pool, _request(), "r1", adapter=adapter, loads=loads)
                double.adapters = Adapters(ENABLED, double)  # the engine restarted: none held
                second = await complete(pool, _request(), "r2", adapter=adapter, loads=loads)
                return first, second, upstream

    first, second, upstream = asyncio.run(scenario())
    assert first.versions == second.versions == [3]  # the engine tags its base weights "0"
    assert loads_of(upstream) == ["run@3", "run@3"]
    assert [body.get("lora_path") for body in upstream.generated] == ["run@3", "run@3"]


def test_an_adapter_no_engine_can_load_is_a_503(tmp_path):
    adapter = ServedAdapter("run", 1, adapter_dir(tmp_path, "a"))

    async def scenario() -> None:
        async with sglang(LoRAFlags(enabled=False)) as (client, _, _), pool_of(client.url) as pool:
            await complete(pool, _request(), "r", adapter=adapter, loads=AdapterLoads())

    with pytest.raises(NoEngineAvailable, match="could not load adapter 'run@1'"):
        asyncio.run(scenario())


def test_a_publish_names_exactly_one_source():
    for body in ({}, {"model_path": "/m", "adapter_path": "/a"}):
        with pytest.raises(ValidationError, match="exactly one of model_path, distributed and"):
            WeightsIn.model_validate(body)
    assert WeightsIn.model_validate({"adapter_path": "/a"}).adapter_path == "/a"


def _adapter(root: Path, config: object = None, weights: bytes | None = None) -> str:
    root.mkdir(parents=True)
    if config is not None:
        (root / "adapter_config.json").write_text(json.dumps(config))
    if weights is not None:
        (root / "adapter_model.safetensors").write_bytes(weights)
    return str(root)


# An empty safetensors file: an 8-byte length, then that many bytes of JSON header.
EMPTY_SAFETENSORS = len(b"{}").to_bytes(8, "little") + b"{}"


@pytest.mark.parametrize(
    ("config", "weights", "says"),
    [
        ({"peft_type": "LORA", "r": 4}, EMPTY_SAFETENSORS, None),
        (None, EMPTY_SAFETENSORS, "no adapter_config.json"),
        ({"peft_type": "PREFIX_TUNING"}, EMPTY_SAFETENSORS, "not a LoRA adapter's config"),
        (["LORA"], EMPTY_SAFETENSORS, "not a LoRA adapter's config"),
        ({"peft_type": "LORA"}, None, "no adapter_model.safetensors"),
        ({"peft_type": "LORA"}, EMPTY_SAFETENSORS[:-1], "adapter_model.safetensors: its header"),
        ({"peft_type": "LORA"}, EMPTY_SAFETENSORS + b"x", "truncated or overwritten"),
    ],
)
def test_an_adapters_files_are_checked_before_any_engine_loads_them(
    tmp_path, config, weights, says
):
    problem = adapter_problem_of(_adapter(tmp_path / "adapter", config, weights))
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem, problem


def test_an_adapter_config_that_is_not_json_or_too_big_is_refused(tmp_path):
    root = Path(_adapter(tmp_path / "a", None, EMPTY_SAFETENSORS))
    (root / "adapter_config.json").write_text("{not json")
    assert "is not JSON" in str(adapter_problem_of(str(root)))
    (root / "adapter_config.json").write_text(" " * (2**20 + 1))
    assert "is over 1,048,576 bytes" in str(adapter_problem_of(str(root)))
    assert adapter_problem_of(str(tmp_path / "elsewhere")) is None  # not this machine's to judge


# ----- a publish's load on every engine -------------------------------------------------------


@asynccontextmanager
async def two_engines(second: LoRAFlags) -> AsyncIterator[list[EngineState]]:
    """Two doubles in rotation: one started with --enable-lora, the other with ``second``."""
    async with sglang() as (first, _, _), sglang(second) as (other, _, _):
        pool = EnginePool([first.url, other.url])
        for engine in pool.engines:
            engine.healthy, engine.context_length = True, 128
        try:
            yield pool.engines
        finally:
            await pool.stop()


def test_a_publish_loads_everywhere_it_can_and_leaves_an_engine_that_refused_in_rotation(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> tuple[list[dict], list[bool], list[bool]]:
        async with two_engines(LoRAFlags(enabled=False)) as engines:
            loads = AdapterLoads()
            results = await load_all(engines, loads, "run@1", path, 30.0)
            held = [loads.holds(e.url, "run@1") for e in engines]
            return results, held, [e.healthy for e in engines]

    results, held, healthy = asyncio.run(scenario())
    assert [r["success"] for r in results] == [True, False]
    assert results[1]["refused"] and "LoRA is not enabled" in results[1]["message"]
    assert held == [True, False] and healthy == [True, True]


def test_a_publish_no_engine_takes_changes_nothing(tmp_path):
    refused_path = adapter_dir(tmp_path, "dora", use_dora=True)

    async def refused() -> None:
        async with two_engines(ENABLED) as engines:
            await load_all(engines, AdapterLoads(), "run@1", refused_path, 30.0)

    with pytest.raises(WeightsRefused, match="No engine loaded the adapter"):
        asyncio.run(refused())

    async def unreachable() -> None:
        pool = EnginePool([f"http://127.0.0.1:{free_port()}"])
        try:
            await load_all(pool.engines, AdapterLoads(), "run@1", adapter_dir(tmp_path, "a"), 30.0)
        finally:
            await pool.stop()

    with pytest.raises(WeightUpdateFailed, match="No engine loaded the adapter") as failed:
        asyncio.run(unreachable())
    assert not isinstance(failed.value, WeightsRefused)  # a 502, not the caller's 400


def test_a_publish_an_engine_does_not_answer_in_time_is_given_up(tmp_path):
    async def scenario() -> None:
        async with sglang(upstream=Upstream(adapters="slow")) as (client, _, _):
            pool = EnginePool([client.url])
            try:
                await load_all(
                    pool.engines, AdapterLoads(), "run@1", adapter_dir(tmp_path, "a"), 1.0
                )
            finally:
                await pool.stop()

    with pytest.raises(WeightUpdateFailed, match="did not load adapter run@1 within 1 s"):
        asyncio.run(scenario())


def test_a_request_whose_engine_is_slow_to_load_the_adapter_goes_to_another(tmp_path, monkeypatch):
    adapter = ServedAdapter("run", 2, adapter_dir(tmp_path, "a"))
    monkeypatch.setattr(generation, "ADAPTER_LOAD_WAIT_S", 0.5)

    async def scenario() -> tuple[str, str, list[int]]:
        slow = Upstream(adapters="slow")  # answers a load after 5 s
        async with sglang(upstream=slow) as (stuck, _, _), sglang() as (fine, _, _):
            pool = EnginePool([stuck.url, fine.url])
            for engine in pool.engines:
                engine.healthy, engine.context_length = True, 128
            try:
                done = await complete(
                    pool, _request(), "r", prefer=stuck.url, adapter=adapter, loads=AdapterLoads()
                )
            finally:
                await pool.stop()
            return done.engine or "", fine.url, done.versions

    served_by, fine_url, versions = asyncio.run(scenario())
    assert served_by == fine_url and versions == [2]


class _Store:
    """A store whose run read waits until told (``release``): what RunAdapters reads."""

    def __init__(self, run: object) -> None:
        self.run, self.release, self.reading = run, asyncio.Event(), asyncio.Event()

    def __call__(self) -> _Store:
        return self

    async def __aenter__(self) -> _Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def get(self, table: object, run_id: str) -> object:
        self.reading.set()
        await self.release.wait()
        return self.run


def test_a_read_under_way_does_not_undo_a_publishs_put():
    old = types.SimpleNamespace(
        id="run", lora=True, policy_version=1, weights_path="/v1", promoted_version=None
    )

    async def scenario() -> tuple[ServedAdapter | None, ServedAdapter | None]:
        store = _Store(old)
        adapters = RunAdapters(store)  # type: ignore[arg-type]
        reading = asyncio.create_task(adapters.get("run"))  # started before the publish
        await store.reading.wait()
        adapters.put(ServedAdapter("run", 2, "/v2"))  # the publish recorded version 2
        store.release.set()
        return await reading, await adapters.get("run")

    during, after = asyncio.run(scenario())
    assert during is not None and during.version == 2
    assert after is not None and after.version == 2
