"""What the proxy makes of SGLang 0.5.23's behaviour (docs/architecture/sglang-protocol.md, "Where a
real SGLang differs from the embedded engine"): where the context length comes from, in-band errors
of a stream, weight-group ranks under tensor parallelism; and requests are never sized against an
unknown context."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from server.engine_client.client import (
    EngineClient,
    EngineRejected,
    EngineUnavailable,
    in_band_error,
)
from server.engine_client.pool import EnginePool, EngineState, reported_context
from server.errors import ContextLengthUnknown, PromptTooLong
from server.proxy.generation import SamplingRequest
from server.proxy.outputs import OpenAIRenderer
from server.proxy.plan import sampling_request
from server.proxy.streaming import first_output, guarded, sse
from server.rl.weights import group_ranks
from server.store.run_config import RunConfig
from tests.sglang_double import in_band_error as sglang_in_band_error
from tests.support import free_port, parse_sse
from trainer.publish import group_world_size


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        ({"message": "too long", "type": "invalid_request_error", "code": 400,
          "retryable": False}, EngineRejected, 400),
        ({"message": "too long", "code": 422}, EngineRejected, 422),
        ({"message": "busy", "code": 429, "retryable": True}, EngineUnavailable, None),
        ({"message": "crashed", "type": "internal_error", "code": 500}, EngineUnavailable, None),
        ({"message": "0.5.10 sends no code"}, EngineUnavailable, None),
        ("a bare string", EngineUnavailable, None),
        ({"message": "odd code", "code": "x"}, EngineUnavailable, None),
    ],
)  # fmt: skip
def test_an_in_band_error_is_a_refusal_only_with_a_4xx_code(error, expected, status):
    raised = in_band_error("http://engine", error)
    assert type(raised) is expected
    if status is not None:
        assert raised.engine_status == status and str(raised) == error["message"]


def test_a_streamed_refusal_after_http_200_raises_engine_rejected():
    """The client reads SGLang's in-band answer (HTTP 200, the error, [DONE]) as a refusal."""
    message = "The input (300 tokens) is longer than the model's context length (128 tokens)."

    async def generate(request: web.Request) -> web.Response:
        return sglang_in_band_error(message)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as http:
                client = EngineClient(f"http://127.0.0.1:{port}", http, generate_timeout=10)
                async for _ in client.generate_stream({"input_ids": [1]}, incremental=False):
                    pass
        finally:
            await runner.cleanup()

    with pytest.raises(EngineRejected) as raised:
        asyncio.run(scenario())
    assert raised.value.engine_status == 400 and str(raised.value) == message


@pytest.mark.parametrize(
    ("server_info", "models", "model_info", "expected"),
    [
        ({"context_length": None}, {"data": [{"max_model_len": 4096}]}, {}, 4096),  # 0.5.23
        ({"context_length": 2048}, {"data": [{"max_model_len": 4096}]}, {}, 2048),  # launch arg
        ({"max_context_length": 1024}, None, {}, 1024),  # the Rust frontend
        ({"context_length": 0}, {"data": []}, {"context_length": 512}, 512),
        ({}, {"data": [{"id": "m"}]}, {"max_model_len": 256}, 256),
        ({"context_length": None}, {"data": [{"id": "m"}]}, {}, None),
        ({"context_length": True}, None, {"context_length": "8192"}, None),  # not ints
        ({"context_length": -1}, {"data": ["odd"]}, {}, None),
    ],
)
def test_the_context_length_comes_from_what_the_engine_reports(
    server_info, models, model_info, expected
):
    assert reported_context(server_info, models, model_info) == expected


@pytest.mark.parametrize(
    ("tp_sizes", "offsets", "world_size"),
    [([1], [1], 2), ([1, 1, 1], [1, 2, 3], 4), ([2, 2], [1, 3], 5), ([4, 1, 2], [1, 5, 6], 8)],
)
def test_weight_group_ranks_follow_tensor_parallel_sizes(tp_sizes, offsets, world_size):
    assert group_ranks(tp_sizes) == (offsets, world_size)
    # The trainer's side of the rendezvous sizes the group the same way from /admin/engines.
    rows = [{"url": f"e{i}", "tp_size": tp} for i, tp in enumerate(tp_sizes)]
    assert group_world_size(rows) == world_size
    assert group_world_size([{"url": "old"}]) == 2  # an engine that reports no tp_size has one


def _body(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"temperature": None, "stops": (), "seed": None, **fields})


def test_no_request_is_sized_against_an_unknown_context():
    with pytest.raises(ContextLengthUnknown) as raised:
        sampling_request(
            SimpleNamespace(context_length=None), [1, 2, 3], None, _body(), 0, RunConfig()
        )
    assert "context length" in raised.value.message


@pytest.mark.parametrize(("prompt", "limit"), [(128, None), (200, None), (100, 29)])
def test_a_request_over_the_context_is_refused(prompt, limit):
    ctx = SimpleNamespace(context_length=128)
    with pytest.raises(PromptTooLong) as raised:
        sampling_request(ctx, list(range(prompt)), limit, _body(), 0, RunConfig())
    assert raised.value.code == "context_length_exceeded"


def test_the_room_left_is_the_default_budget():
    ctx = SimpleNamespace(context_length=128)
    assert sampling_request(ctx, list(range(100)), None, _body(), 0, RunConfig()).max_tokens == 28
    assert sampling_request(ctx, list(range(100)), 28, _body(), 0, RunConfig()).max_tokens == 28


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_a_sampling_request_asks_for_at_least_one_token(max_tokens):
    with pytest.raises(ValueError, match="at least 1"):
        SamplingRequest(prompt_ids=[1], max_tokens=max_tokens)


def test_a_failure_before_any_output_is_raised_before_the_stream_starts():
    async def refused() -> None:
        raise EngineRejected(400, "too long")

    async def scenario() -> None:
        work = asyncio.create_task(refused())
        await first_output(work, asyncio.Event())

    with pytest.raises(EngineRejected):
        asyncio.run(scenario())


def test_a_failure_after_output_comes_in_band_in_the_api_shape():
    async def scenario() -> list:
        produced = asyncio.Event()

        async def work() -> None:
            produced.set()
            await asyncio.sleep(0)
            raise EngineRejected(400, "too long")

        task = asyncio.create_task(work())
        await first_output(task, produced)  # output came: nothing raised here

        async def events():
            yield "data: {}\n\n"
            await asyncio.gather(task)

        def on_error(error: Exception) -> str:
            return "".join(sse(event) for event in OpenAIRenderer.error(error))

        done = "".join(sse(event) for event in OpenAIRenderer.closing())
        return [event async for event in guarded(events(), task, on_error, done)]

    events = parse_sse("".join(asyncio.run(scenario())))
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "The engine refused the request: too long",
            "type": "invalid_request_error",
            "param": None,
            "code": "engine_rejected",
        }
    }


def _check_against(server_info: object, models: object) -> EngineState:
    """One health check of a pool on a fake engine answering these bodies; the engine's state."""

    def answering(body: object):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(body)

        return handler

    async def scenario() -> EngineState:
        app = web.Application()
        app.router.add_get("/model_info", answering({"weight_version": "0"}))
        app.router.add_get("/server_info", answering(server_info))
        app.router.add_get("/v1/models", answering(models))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pool = EnginePool([f"http://127.0.0.1:{port}"])
        try:
            for _ in range(3):  # repeated checks: what a health loop does
                await pool.check(pool.engines[0])
            return pool.engines[0]
        finally:
            await pool.stop()
            await runner.cleanup()

    return asyncio.run(scenario())


@pytest.mark.parametrize(("dp", "pp"), [(2, 1), (1, 2)])
def test_an_engine_with_data_or_pipeline_parallelism_stays_out_of_rotation(dp, pp):
    """Its ranks would not be where the weight group puts them; kept out, not counted failed."""
    info = {"context_length": 128, "tp_size": 1, "dp_size": dp, "pp_size": pp}
    engine = _check_against(info, {"data": []})
    assert not engine.healthy and engine.failures == 0
    assert f"dp_size={dp}, pp_size={pp}" in (engine.last_error or "")


@pytest.mark.parametrize(
    ("server_info", "models"),
    [([1, 2], {"data": []}), ({"context_length": None}, {"data": {"max_model_len": 1}})],
)
def test_an_answer_of_an_unexpected_shape_marks_the_engine_down(server_info, models):
    """A list for /server_info, a dict for /v1/models' data: the check survives (the health
    loop would otherwise end and no engine come back) and says what it got."""
    engine = _check_against(server_info, models)
    assert not engine.healthy and "unexpected answer" in (engine.last_error or "")


def test_an_unknown_context_is_not_counted_as_a_failure():
    engine = _check_against({"context_length": None}, {"data": [{"id": "m"}]})
    assert not engine.healthy and engine.failures == 0
    assert "context length is unknown" in (engine.last_error or "")


def test_a_probe_that_overlaps_a_weight_swap_does_not_take_the_engine_out():
    """A health probe reads the engine's version while a swap is on: it may read the version of
    either side of the swap. Judged against the pool's expected version afterwards, it took a
    good engine out of rotation for a probe interval (503s on chats and the next publish);
    now a probe that overlapped a swap decides nothing, and the next one judges."""

    async def scenario() -> tuple[bool, bool]:
        reading, release = asyncio.Event(), asyncio.Event()
        state = {"version": "1", "probes": 0}

        async def model_info(request: web.Request) -> web.Response:
            answer = {"weight_version": state["version"], "context_length": 64}
            state["probes"] += 1
            if state["probes"] == 2:  # the second probe reads, then waits out the swap
                reading.set()
                await release.wait()
            return web.json_response(answer)

        async def server_info(request: web.Request) -> web.Response:
            return web.json_response({"context_length": 64, "tp_size": 1})

        app = web.Application()
        app.router.add_get("/model_info", model_info)
        app.router.add_get("/server_info", server_info)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pool = EnginePool([f"http://127.0.0.1:{port}"])
        engine = pool.engines[0]
        try:
            pool.expected_version = 1
            assert await pool.check(engine)
            probe = asyncio.create_task(pool.check(engine))
            await reading.wait()  # the probe has read version 1; now a swap to 2 completes
            async with pool.update_lock:
                state["version"] = "2"
                pool.expected_version = 2
            release.set()
            during = await probe and engine.healthy
            after = await pool.check(engine)
            return during, after
        finally:
            await pool.stop()
            await runner.cleanup()

    during, after = asyncio.run(scenario())
    assert during, "a probe overlapping a swap took the engine out of rotation"
    assert after
