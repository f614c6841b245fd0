"""A publish's load is bounded: engines whose load has not finished within the limit are given
up on (the caller resumes them) with a 502 weights_load_timeout, at the limit, not at the
engines' own timeout."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from server.errors import WeightUpdateFailed
from server.rl.weights import _load_within


def test_a_load_past_the_limit_is_abandoned_at_the_limit():
    async def stuck(engine):
        await asyncio.sleep(60)  # a load blocked on a hung mount
        return {"success": True}

    async def scenario() -> float:
        engines = [SimpleNamespace(url="http://engine-a"), SimpleNamespace(url="http://engine-b")]
        started = time.perf_counter()
        with pytest.raises(WeightUpdateFailed) as failed:
            await _load_within(engines, stuck, 0.3, "/weights")  # type: ignore[arg-type]
        assert failed.value.status == 502 and failed.value.code == "weights_load_timeout"
        assert "within 0.3 s" in failed.value.message
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 1.0


def test_loads_within_the_limit_are_returned():
    async def quick(engine):
        return {"success": True, "message": "loaded"}

    engines = [SimpleNamespace(url="http://engine-a")]
    results = asyncio.run(_load_within(engines, quick, 5.0, "/weights"))  # type: ignore[arg-type]
    assert results == [{"url": "http://engine-a", "success": True, "message": "loaded"}]
