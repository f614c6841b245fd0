"""A stream coalesces tokens that come faster than its bound (the server's
``stream_interval_ms``, at its default) into few events, and
loses, reorders and delays none of them beyond that bound (issue 27: a streamed request cost
3.1x a non-streamed one, most of it per event).

A real ``proxrl serve`` in front of the stub engine (bench/stub_engine.py) sending 40 tokens a
chunk each, 2 ms apart: one client streams a chat with logprobs. The text of its deltas must be
the stored turn's answer, and their logprobs the stored ones, in order; there must be far fewer
content events than tokens (one per token before: 40), at most one per linger of the stream's
time besides the first.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import httpx
import pytest

from bench.common import StubEngine
from server.settings import ServerSettings
from tests.support import ProxyProcess, stream_events

TOKENS, CHUNK_MS = 40, 2.0
STREAM_INTERVAL_S = ServerSettings.model_fields["stream_interval_ms"].default / 1000


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fast_stream_goes_out_in_few_events_and_whole(tiny_model_dir: Path, tmp_path: Path):
    with (
        StubEngine(tiny_model_dir, tmp_path / "stub.log", TOKENS, CHUNK_MS) as stub,
        ProxyProcess(tiny_model_dir, tmp_path, "--engines", stub.url) as proxy,
    ):
        session = proxy.session()
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Count to forty."}],
            "max_tokens": 2 * TOKENS,
            "stream": True,
            "logprobs": True,
        }

        arrivals: list[float] = []

        async def run() -> list:
            headers = {"Authorization": f"Bearer {session['api_key']}"}
            async with httpx.AsyncClient(headers=headers, timeout=60) as client:
                url = f"{session['base_url']}/chat/completions"
                return await stream_events(
                    client, url, body, on_chunk=lambda _: arrivals.append(time.monotonic())
                )

        events = asyncio.run(run())
        (turn,) = proxy.get_session(session["session_id"])["turns"]

    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    # the chunks of newly sampled tokens carry their logprobs; the last ones what was held back
    deltas = [c["choices"][0] for c in chunks if c["choices"][0]["logprobs"] is not None]
    logprobs = [entry["logprob"] for d in deltas for entry in d["logprobs"]["content"]]
    assert len(turn["completion_ids"]) == TOKENS
    assert text == turn["response"]["content"]
    assert logprobs == pytest.approx(turn["logprobs"], abs=1e-6)
    # Past the first event (sent at once), each one waited STREAM_INTERVAL_S for more tokens,
    # unless the answer ended sooner: one per linger of the stream's time at most (as the client
    # saw it, from its first chunk to its last), and one that the answer's end cut short.
    seconds = arrivals[-1] - arrivals[0]
    assert len(deltas) <= 2 + math.ceil(seconds / STREAM_INTERVAL_S), (len(deltas), seconds)
    assert len(deltas) < TOKENS / 4, len(deltas)
