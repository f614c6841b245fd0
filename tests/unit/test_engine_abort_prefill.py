"""An abort reaches a long prefill at its next chunk, not after the whole prompt.

A 32k-token prompt takes minutes to prefill on a CPU. A client that goes away during it (the
proxy then aborts its request) or an admin's ``/abort_request`` used to wait in the scheduler's
command queue until the prefill ended, and then the request was aborted at once: minutes of
prefill for nobody. Through the real EngineService, with each chunk slowed down so the prefill
is long: the request ends with ``finish_reason`` abort within a few chunks of the abort, the
other requests are untouched, and the engine serves the next request.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from server.engine import protocol
from server.engine.service import EngineService
from server.engine.settings import EngineSettings

CHUNK = 16
PROMPT = 1600  # 100 chunks
CHUNK_S = 0.05  # each chunk slowed to this: the whole prefill takes 5 s or more


@pytest.fixture
def service(tiny_model_dir, monkeypatch):
    service = EngineService(
        EngineSettings(model=str(tiny_model_dir), device="cpu", seed=3, prefill_chunk=CHUNK)
    )
    chunks = {"count": 0}
    prefill = service.runner.prefill

    def slow_prefill(slot, ids, cancelled=None, **kwargs):
        def between_chunks() -> bool:
            chunks["count"] += 1
            time.sleep(CHUNK_S)
            return cancelled is not None and cancelled()

        return prefill(slot, ids, cancelled=between_chunks, **kwargs)

    monkeypatch.setattr(service.runner, "prefill", slow_prefill)
    service.chunks = chunks  # type: ignore[attr-defined]
    service.scheduler.start()
    yield service
    service.close()


def request(rid: str, length: int, max_new_tokens: int = 4) -> protocol.GenerateRequestIn:
    return protocol.GenerateRequestIn(
        rid=rid,
        input_ids=[3 + i % 600 for i in range(length)],
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True},
    )


def generate(service: EngineService, body: protocol.GenerateRequestIn) -> dict:
    items, _ = service.parse(body)
    return asyncio.run(service.generate(body, items))[0]


def wait_for_chunks(service: EngineService, count: int) -> None:
    deadline = time.monotonic() + 30
    while service.chunks["count"] < count:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the prefill did not start"
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["client_gone", "abort_request_prefix", "abort_all"])
def test_an_abort_stops_a_long_prefill_at_its_next_chunk(service, how):
    results: list[dict] = []
    long = threading.Thread(
        target=lambda: results.append(generate(service, request("long-1", PROMPT)))
    )
    long.start()
    wait_for_chunks(service, 5)
    asked_at = time.monotonic()
    if how == "client_gone":  # what the proxy's engine client does when its caller went away
        (seq,) = [s for s in service.scheduler._in_flight.values() if s.rid == "long-1"]
        service.abort_sequences([seq])
    else:
        rid, everything = ("long", False) if how == "abort_request_prefix" else ("", True)
        service.scheduler.abort_soon(rid, abort_all=everything).result(timeout=30)
    long.join(timeout=30)
    took = time.monotonic() - asked_at
    assert not long.is_alive()
    (result,) = results
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] == 0
    assert took < 20 * CHUNK_S, f"the abort took {took:.2f} s: it waited for the prefill"
    assert service.chunks["count"] < PROMPT // CHUNK  # type: ignore[attr-defined]
    served = generate(service, request("next-1", 40))  # the engine goes on serving
    assert served["meta_info"]["finish_reason"]["type"] == "length"
    assert served["meta_info"]["completion_tokens"] == 4


def test_an_abort_for_another_request_leaves_the_prefill_alone(service):
    results: list[dict] = []
    long = threading.Thread(
        target=lambda: results.append(generate(service, request("kept-1", 320)))
    )
    long.start()
    wait_for_chunks(service, 3)
    assert service.scheduler.abort_soon("other", exact=True).result(timeout=30) == 0
    long.join(timeout=60)
    (result,) = results
    assert result["meta_info"]["finish_reason"]["type"] == "length"
    assert result["meta_info"]["completion_tokens"] == 4
    assert service.scheduler._aborting == []  # nothing asked for is left behind


def test_a_shutdown_after_the_callers_loop_closed_raises_nothing_in_the_scheduler(
    service, monkeypatch
):
    """The scheduler's last act on shutdown aborts what waits or runs and tells each listener;
    a caller's event loop may be closed by then (a server stopping, a test's loop ending). The
    scheduler thread used to die there with ``RuntimeError: Event loop is closed`` (a CI run's
    unhandled thread exception in test_api_engine_failures)."""
    crashes: list = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    service.scheduler.call(lambda: service.scheduler.pause("in_place")).result(timeout=30)
    loop = asyncio.new_event_loop()
    body = request("orphan-1", 40)
    items, _ = service.parse(body)
    task = loop.create_task(service.generate(body, items))
    loop.run_until_complete(asyncio.sleep(0.05))  # submitted and held: the engine is paused
    assert [seq.rid for seq in service.scheduler.waiting] == [items[0].rid]
    task.cancel()  # the caller's loop ends without waiting for the engine
    loop.close()
    service.close()  # the scheduler aborts the orphan and tells its closed loop
    assert not service.scheduler._looping
    assert crashes == []
