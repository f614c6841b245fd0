"""The engine client's LoRA adapter calls, against the SGLang double (SGLang's
multi-LoRA answers: docs/architecture/sglang-protocol.md, "LoRA adapters").

The double runs in this process in front of a small engine of our own (``Upstream``) that takes
adapter loads and generate requests and records them; the double keeps SGLang's registry
(what is loaded, in least-recently-used order, pinned or not, running requests) and answers as
SGLang does. What the engine itself does with an adapter is the embedded engine's business,
tested with it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine_client import sglang as launcher
from server.engine_client.client import EngineClient
from server.errors import EngineRejected, EngineTimedOut
from server.settings import ServerSettings
from tests.sglang_double import Adapters, Double, LoRAFlags, lora_flags, parse_args
from tests.support import free_port

ENABLED = LoRAFlags(enabled=True)


class Upstream:
    """The engine behind the double: answers adapter loads (``adapters``: "ok", "absent" for an
    engine without the routes, "slow" for one that does not answer in time) and generate
    requests (after ``generate_delay_s``), and records both."""

    def __init__(self, adapters: str = "ok", generate_delay_s: float = 0.0) -> None:
        self.adapters = adapters
        self.generate_delay_s = generate_delay_s
        self.calls: list[tuple[str, dict]] = []
        self.generated: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/load_lora_adapter", self.adapter)
        app.router.add_post("/unload_lora_adapter", self.adapter)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        return app

    async def adapter(self, request: web.Request) -> web.Response:
        if self.adapters == "absent":
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.adapters == "slow":
            await asyncio.sleep(5)
        self.calls.append((request.path, await request.json()))
        return web.json_response({"success": True, "error_message": ""})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.generated.append(body)
        await asyncio.sleep(self.generate_delay_s)
        meta = {
            "id": body.get("rid", "r"),
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 1,
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, 7, None]],
        }
        return web.json_response({"text": "", "output_ids": [7], "meta_info": meta})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "base", "object": "model", "root": "base", "max_model_len": 128}
        return web.json_response({"object": "list", "data": [card]})

    async def model(self, request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["model"], "object": "model"})


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sglang(
    flags: LoRAFlags = ENABLED, upstream: Upstream | None = None
) -> AsyncIterator[tuple[EngineClient, Double, Upstream]]:
    """A client of a double (SGLang started with ``flags``) in front of ``upstream``."""
    upstream = upstream or Upstream()
    async with serving(upstream.app()) as engine_url:
        double = Double(engine_url, 1, None, None, flags)
        async with serving(double.app()) as url, aiohttp.ClientSession() as http:
            yield EngineClient(url, http, generate_timeout=30), double, upstream


def adapter_dir(root: Path, name: str, rank: int = 4, **config: Any) -> str:
    """An adapter directory's config in peft's format (the double reads only the config)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps({**body, **config}))
    return str(directory)


def run(scenario: Callable[[], Any]) -> Any:
    return asyncio.run(scenario())


def generate_body(lora_path: Any = None, stream: bool = False) -> dict:
    body: dict[str, Any] = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return {**body, "stream": stream} if stream else body


# ----- load and unload ------------------------------------------------------------------------


def test_an_adapter_loads_and_unloads_by_name(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> tuple[dict, list, list, dict, list]:
        async with sglang() as (client, _, upstream):
            loaded = await client.load_lora_adapter("run@1", path)
            cards = (await client.models())["data"]
            async with aiohttp.ClientSession() as http:
                found = []
                for model in ("base", "run@1"):
                    async with http.get(f"{client.url}/v1/models/{model}") as reply:
                        found.append((reply.status, await reply.json()))
            unloaded = await client.unload_lora_adapter("run@1")
            return loaded, cards, found, unloaded, upstream.calls

    loaded, cards, found, unloaded, calls = run(scenario)
    assert loaded["success"] is True and loaded["error_message"] == ""
    assert loaded["loaded_adapters"] == {"run@1": path}
    assert [card["id"] for card in cards] == ["base", "run@1"]
    assert cards[1]["parent"] == "base" and cards[1]["root"] == path
    assert cards[1]["max_model_len"] is None and cards[0]["max_model_len"] == 128
    assert found[0] == (200, {"id": "base", "object": "model"})
    assert found[1][0] == 404 and found[1][1]["error"]["code"] == "model_not_found"
    assert unloaded["success"] is True and unloaded["loaded_adapters"] == {}
    assert calls == [
        ("/load_lora_adapter", {"lora_name": "run@1", "lora_path": path, "pinned": False}),
        ("/unload_lora_adapter", {"lora_name": "run@1"}),
    ]


def test_a_name_is_loaded_once(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> None:
        async with sglang() as (client, _, _):
            await client.load_lora_adapter("run@1", path)
            await client.load_lora_adapter("run@1", path)

    with pytest.raises(EngineRejected) as refused:
        run(scenario)
    assert refused.value.engine_status == 400
    assert str(refused.value) == "Failed to load LoRA adapter run@1 because it is already loaded"


def test_an_unknown_name_is_not_unloaded(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> None:
        async with sglang() as (client, _, _):
            await client.load_lora_adapter("run@1", path)
            await client.unload_lora_adapter("run@2")

    with pytest.raises(EngineRejected) as refused:
        run(scenario)
    assert refused.value.engine_status == 400
    assert str(refused.value) == (
        "LoRA with name run@2 does not exist. Loaded LoRAs: odict_keys(['run@1'])"
    )


def test_an_engine_started_without_lora_refuses_loads_and_requests(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> tuple[EngineRejected, EngineRejected, EngineRejected]:
        async with sglang(LoRAFlags(enabled=False)) as (client, _, _):
            refusals = []
            for call in (
                client.load_lora_adapter("run@1", path),
                client.unload_lora_adapter("run@1"),
                client.generate(generate_body("run@1")),
            ):
                with pytest.raises(EngineRejected) as refused:
                    await call
                refusals.append(refused.value)
            return refusals[0], refusals[1], refusals[2]

    load, unload, generate = run(scenario)
    assert (
        str(load)
        == str(unload)
        == ("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    )
    assert generate.engine_status == 400 and str(generate).startswith(
        "LoRA adapter 'run@1' was requested, but LoRA is not enabled."
    )


def test_an_adapter_load_that_outlasts_its_timeout_is_a_timeout(tmp_path):
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> None:
        async with sglang(upstream=Upstream(adapters="slow")) as (client, _, _):
            await client.load_lora_adapter("run@1", path, timeout_s=0.3)

    with pytest.raises(EngineTimedOut, match=r"did not answer within 0\.3 s"):
        run(scenario)


def test_an_engine_without_the_routes_is_refused_with_its_404(tmp_path):
    """An engine that has no adapter routes (an SGLang before them, or another server)."""
    path = adapter_dir(tmp_path, "a")

    async def scenario() -> None:
        async with (
            serving(Upstream(adapters="absent").app()) as url,
            aiohttp.ClientSession() as http,
        ):
            await EngineClient(url, http, generate_timeout=5).load_lora_adapter("run@1", path)

    with pytest.raises(EngineRejected) as refused:
        run(scenario)
    assert refused.value.engine_status == 404


def test_pinned_adapters_leave_a_slot_for_the_rest(tmp_path):
    flags = LoRAFlags(enabled=True, max_per_batch=2)

    async def scenario() -> dict:
        async with sglang(flags) as (client, _, _):
            await client.load_lora_adapter("a", adapter_dir(tmp_path, "a"), pinned=True)
            with pytest.raises(EngineRejected, match="as a pinned adapter"):
                await client.load_lora_adapter("b", adapter_dir(tmp_path, "b"), pinned=True)
            return await client.load_lora_adapter("b", adapter_dir(tmp_path, "b"))

    assert set(run(scenario)["loaded_adapters"]) == {"a", "b"}


def test_an_adapter_the_launch_flags_cannot_hold_is_refused(tmp_path):
    flags = LoRAFlags(enabled=True, max_rank=8, target_modules=["q_proj", "v_proj"])

    async def scenario() -> list[str]:
        async with sglang(flags) as (client, _, _):
            await client.load_lora_adapter("fits", adapter_dir(tmp_path, "fits", rank=8))
            messages = []
            for name, config in (
                ("wide", {"r": 16}),
                ("elsewhere", {"target_modules": ["o_proj"]}),
                ("dora", {"use_dora": True}),
            ):
                with pytest.raises(EngineRejected) as refused:
                    await client.load_lora_adapter(name, adapter_dir(tmp_path, name, **config))
                messages.append(str(refused.value))
            return messages

    wide, elsewhere, dora = run(scenario)
    assert wide.startswith("LoRA adapter wide with rank 16 is incompatible")
    assert elsewhere.startswith("LoRA adapter elsewhere with rank 4 is incompatible")
    assert dora == (
        "Failed to load dora because LoRA serving currently doesn't support DoRA adapters"
    )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--enable-lora"], "you need to specify both --max-lora-rank and --lora-target-modules"),
        (["--enable-lora", "--max-lora-rank", "8"], "you need to specify both"),
        (["--enable-lora", "--lora-target-modules", "q_proj"], "you need to specify both"),
        (
            ["--max-loaded-loras", "2", "--max-loras-per-batch", "4"],
            "max_loaded_loras should be greater than or equal to max_loras_per_batch",
        ),
    ],
)
def test_sglang_does_not_start_with_lora_flags_it_cannot_size(flags, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", *flags])
    assert says in capsys.readouterr().err


def test_the_launcher_starts_sglang_with_the_lora_flags_it_needs():
    """The command proxrl runs starts SGLang (here the double, which takes SGLang's flags) with
    LoRA enabled and the pool sized as asked."""
    limits = launcher.LoRALimits(
        max_rank=16, target_modules=("q_proj", "v_proj"), max_loaded=6, max_per_batch=4
    )
    config = ServerSettings(model="/models/qwen", engine="sglang", sglang_args="--foo 1")
    argv = launcher.command(config, 0, 30000, limits)
    assert argv[-2:] == ["--foo", "1"]  # the user's flags come last
    started = lora_flags(parse_args(argv[3:-2]))
    assert started == LoRAFlags(
        enabled=True,
        max_loaded=6,
        max_per_batch=4,
        max_rank=16,
        target_modules=["q_proj", "v_proj"],
    )
    assert "--enable-lora" not in launcher.command(config, 0, 30000)


@pytest.mark.parametrize("arg", ["--max-loaded-loras 9", "--enable-lora", "--max-lora-rank=64"])
def test_the_lora_flags_proxrl_sets_are_not_set_again_by_the_user(arg):
    limits = launcher.LoRALimits(
        max_rank=8, target_modules=("q_proj",), max_loaded=4, max_per_batch=4
    )
    config = ServerSettings(model="/models/qwen", engine="sglang", sglang_args=arg)
    with pytest.raises(ValueError, match="proxrl sets it for LoRA runs"):
        launcher.command(config, 0, 30000, limits)


def test_lora_limits_sglang_would_not_start_with_are_refused():
    with pytest.raises(ValueError, match="must be at least max_per_batch"):
        launcher.LoRALimits(max_rank=8, target_modules=("q_proj",), max_loaded=2, max_per_batch=4)
    with pytest.raises(ValueError, match="needs a rank, target modules"):
        launcher.LoRALimits(max_rank=8, target_modules=(), max_loaded=4, max_per_batch=4)


# ----- past the bound: evicted, and reloaded on demand ---------------------------------------


def test_past_the_bound_the_least_recently_used_unpinned_adapter_is_unloaded(tmp_path):
    """SGLang does not refuse a load past --max-loaded-loras: it unloads the least recently used
    unpinned adapter (a request counts as a use), and a request for it later loads it again."""
    flags = LoRAFlags(enabled=True, max_loaded=2, max_per_batch=2)

    async def scenario() -> tuple[dict, dict, list, list]:
        async with sglang(flags) as (client, _, upstream):
            await client.load_lora_adapter("a", adapter_dir(tmp_path, "a"))
            await client.load_lora_adapter("b", adapter_dir(tmp_path, "b"))
            await client.generate(generate_body("a"))  # a is now used after b
            third = await client.load_lora_adapter("c", adapter_dir(tmp_path, "c"))
            await client.generate(generate_body("b"))  # b was evicted: loaded again, a goes
            cards = [card["id"] for card in (await client.models())["data"]]
            return third, upstream.generated[-1], cards, upstream.calls

    third, last_request, cards, calls = run(scenario)
    assert third["success"] is True and set(third["loaded_adapters"]) == {"a", "c"}
    assert last_request["lora_path"] == "b"
    assert cards == ["base", "c", "b"]
    assert [(path, body["lora_name"]) for path, body in calls] == [
        ("/load_lora_adapter", "a"),
        ("/load_lora_adapter", "b"),
        ("/load_lora_adapter", "c"),
        ("/unload_lora_adapter", "b"),
        ("/load_lora_adapter", "b"),
        ("/unload_lora_adapter", "a"),
    ]


def test_a_name_never_loaded_is_refused_whole_or_streamed(tmp_path):
    async def scenario() -> list[EngineRejected]:
        async with sglang() as (client, _, upstream):
            await client.load_lora_adapter("a", adapter_dir(tmp_path, "a"))
            refusals = []
            with pytest.raises(EngineRejected) as whole:
                await client.generate(generate_body("nobody"))
            refusals.append(whole.value)
            with pytest.raises(EngineRejected) as streamed:
                async for _ in client.generate_stream(generate_body("nobody"), incremental=False):
                    pass
            refusals.append(streamed.value)
            assert upstream.generated == []
            return refusals

    for refusal in run(scenario):
        assert refusal.engine_status == 400
        assert str(refusal) == (
            "Got LoRA adapter that has never been loaded: nobody\n"
            "All loaded adapters: dict_keys(['a'])."
        )


def test_lora_path_reaches_the_engine_unchanged_per_item(tmp_path):
    """A name, or a list with one per batch item (null: the base model), as it was sent."""

    async def scenario() -> tuple[list, dict, list]:
        async with sglang() as (client, _, upstream):
            await client.load_lora_adapter("a", adapter_dir(tmp_path, "a"))
            await client.load_lora_adapter("b", adapter_dir(tmp_path, "b"))
            piece = await client.generate(generate_body("a"))
            async with aiohttp.ClientSession() as http:
                batch = {
                    "input_ids": [[1], [2], [3]],
                    "lora_path": ["b", None, "a"],
                    "sampling_params": {"max_new_tokens": 1},
                }
                async with http.post(f"{client.url}/generate", json=batch) as reply:
                    assert reply.status == 200
            return piece.ids, upstream.generated[0], [g["lora_path"] for g in upstream.generated]

    ids, first, forwarded = run(scenario)
    assert ids == [7] and first["lora_path"] == "a"
    assert forwarded == ["a", ["b", None, "a"]]


def test_an_unload_waits_for_the_requests_running_on_the_adapter(tmp_path):
    async def scenario() -> list[str]:
        upstream = Upstream(generate_delay_s=0.5)
        async with sglang(upstream=upstream) as (client, _, _):
            await client.load_lora_adapter("a", adapter_dir(tmp_path, "a"))
            order: list[str] = []

            async def request() -> None:
                await client.generate(generate_body("a"))
                order.append("request ended")

            async def unload() -> None:
                await asyncio.sleep(0.1)  # the request is running
                await client.unload_lora_adapter("a")
                order.append("unloaded")

            await asyncio.gather(request(), unload())
            return order

    assert run(scenario) == ["request ended", "unloaded"]


class _Engine:
    """The engine side of ``Adapters`` when no engine is behind it."""

    async def adapter_call(self, path: str, body: dict) -> None:
        return None


@settings(max_examples=60, deadline=None)
@given(
    bound=st.integers(min_value=2, max_value=4),
    steps=st.lists(
        st.tuples(st.sampled_from(["load", "pin", "use", "unload"]), st.integers(0, 5)),
        max_size=30,
    ),
)
def test_the_registry_never_holds_more_than_the_bound_nor_evicts_a_pinned_adapter(bound, steps):
    """Whatever the order of loads, pins, requests and unloads: at most --max-loaded-loras
    adapters, every pinned adapter kept until unloaded, and a request for a name loaded before
    served, unless it was pinned, unloaded since, and its reload (pinned again, as SGLang does)
    finds every pin slot taken."""

    async def scenario() -> None:
        flags = LoRAFlags(enabled=True, max_loaded=bound, max_per_batch=bound)
        adapters = Adapters(flags, _Engine())  # type: ignore[arg-type]
        pinned: set[str] = set()
        for action, index in steps:
            name = f"run@{index}"
            if action in ("load", "pin"):
                pin = action == "pin"
                success, message, _ = await adapters.load(name, f"/adapters/{index}", pin)
                if success and pin:
                    pinned.add(name)
                assert success or "already loaded" in message or "pinned" in message
            elif action == "use" and name in adapters.ever:
                try:
                    held = await adapters.acquire(name)
                except ValueError as exc:  # reloaded pinned, as it was loaded: no pin slot left
                    assert adapters.ever[name][1] and "as a pinned adapter" in str(exc)
                    assert str(exc).startswith(f"Failed to implicitly load LoRA adapter {name}")
                else:
                    assert [adapters.loaded[name]] == held
                    await adapters.release(held)
            elif action == "unload":
                held_now = name in adapters.loaded
                success, _, _ = await adapters.unload(name)
                assert success == held_now and name not in adapters.loaded
                pinned.discard(name)
            assert len(adapters.loaded) <= bound
            assert pinned <= set(adapters.loaded)

    run(scenario)
