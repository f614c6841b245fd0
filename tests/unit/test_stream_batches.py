"""A stream's plumbing on the proxy's side, with real asyncio and no server.

``streaming.drain`` takes what a stream's work puts in its ``Inbox`` (once per engine chunk, no
await) in batches under the latency bound: the first at once, each later one what came within
the bound (less when the work ends), every item once and in order, the end at once.
``EngineClient._read`` makes one piece of the events of one read (an engine that got ahead of
the proxy), keeps the tokens that came before an in-band error, and makes none of a read
without tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from server.engine_client.client import EngineClient
from server.errors import EngineRejected
from server.proxy.streaming import Inbox, drain

BOUND_S = 0.2  # long beside the 1 ms between items: a loaded machine still batches them


async def _batches(gaps_s: list[float], bound_s: float) -> list[tuple[list[int], float, float]]:
    """Items 0.. put after ``gaps_s`` pauses; each batch, when it came and its deadline."""
    loop = asyncio.get_running_loop()
    inbox = Inbox()

    async def work() -> None:
        for index, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            inbox.put(index)

    task = asyncio.create_task(work())
    return [(batch, loop.time(), deadline) async for batch, deadline in drain(task, inbox, bound_s)]


@pytest.mark.timeout(10)
def test_the_first_item_goes_at_once_and_the_rest_within_the_bound_in_one_batch():
    batches = asyncio.run(_batches([0.0] + [0.001] * 5, BOUND_S))
    assert [batch for batch, _, _ in batches] == [[0], [1, 2, 3, 4, 5]]
    (_, first_at, first_due), (_, last_at, last_due) = batches
    assert first_due <= first_at + 0.001  # due at once
    assert last_due == pytest.approx(first_at + BOUND_S, abs=0.1)
    assert last_at < last_due  # the work ended: its last items did not wait for the bound


@pytest.mark.timeout(10)
def test_without_a_bound_every_batch_is_what_is_waiting():
    batches = asyncio.run(_batches([0.0, 0.01, 0.01], 0.0))
    assert [batch for batch, _, _ in batches] == [[0], [1], [2]]


@pytest.mark.timeout(10)
def test_items_that_come_after_the_bound_go_in_a_later_batch():
    batches = asyncio.run(_batches([0.0, 0.001, 0.2], 0.05))
    assert [batch for batch, _, _ in batches] == [[0], [1], [2]]


@pytest.mark.timeout(10)
def test_work_that_puts_nothing_makes_no_batch():
    assert asyncio.run(_batches([], BOUND_S)) == []


def _event(ids: list[int], finish: dict | None = None) -> bytes:
    meta = {
        "finish_reason": finish,
        "prompt_tokens": 3,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, token, None] for token in ids],
    }
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": meta}).encode()


def test_the_events_of_one_read_make_one_piece():
    client = EngineClient("http://engine", None, 60.0)  # type: ignore[arg-type]
    lines = [_event([5]), b"", _event([6, 7]), b"", _event([8], {"type": "stop"}), b""]
    piece, done, error = client._read(lines, 0, incremental=True)
    assert piece is not None and (done, error) == (False, None)
    assert piece.ids == [5, 6, 7, 8]
    assert piece.logprobs == [-0.5] * 4
    assert piece.versions == ["7"] * 4
    assert piece.finish_reason == {"type": "stop"}


def test_a_read_without_tokens_makes_no_piece_and_tokens_before_an_error_are_kept():
    client = EngineClient("http://engine", None, 60.0)  # type: ignore[arg-type]
    assert client._read([b": keep-alive", b""], 0, incremental=True) == (None, False, None)
    assert client._read([b"data: [DONE]", b""], 0, incremental=True) == (None, True, None)
    refused = b'data: {"error": {"message": "too long", "code": 400}}'
    piece, done, error = client._read([_event([5]), b"", refused], 0, incremental=True)
    assert piece is not None and piece.ids == [5]
    assert not done and isinstance(error, EngineRejected)
