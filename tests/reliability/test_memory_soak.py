"""The proxy's memory stays flat under mixed traffic once its caches are full.

A real ``proxrl serve`` (its engine a separate process, so the proxy's RSS is the proxy's own)
takes SOAK_MINUTES of mixed traffic from six workers: new sessions, chat (whole and streamed),
Responses, Anthropic messages, rewards and ends, and a long conversation per worker that goes on
for ten turns before a new one starts. Its caches are given small byte bounds so that they
fill during the warm-up; after it, RSS is sampled every 10 s and its slope (least squares) must
stay under MAX_SLOPE_MB_PER_MIN (1 MB/min for a run of 30 minutes or more; 3 MB/min for the short
run, which only catches gross leaks). Every answered turn must be in the store and no answer a
5xx.

Three minutes in the slow tier; ``PROXRL_SOAK_MINUTES=30`` for the long run by hand.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support import EngineProcess, ProxyProcess

SOAK_MINUTES = float(os.environ.get("PROXRL_SOAK_MINUTES", "3"))
WARMUP_S = 60.0 if SOAK_MINUTES <= 6 else 300.0
SAMPLE_EVERY_S = 10.0
# Flat, for the long run by hand. The 3-minute run measures its slope over 2 minutes, too short
# to tell bounded pools still filling from a leak: it measured +0.97 and +1.29 MB/min on the
# fixed code and +2.27 on the old, so in CI it only holds off leaks the size of the issue's
# (6.5 MB/min); flatness is the long run's to show.
MAX_SLOPE_MB_PER_MIN = 1.0 if SOAK_MINUTES >= 30 else 3.0
WORKERS = 6
# Small bounds, so that the caches are full before the warm-up ends.
CACHE_FLAGS = ["--session-cache-mb", "2", "--lookup-cache-mb", "0.25"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_MINUTES * 60 + 600))]


@dataclass
class Tally:
    requests: int = 0
    errors: dict[int, int] = field(default_factory=dict)  # status: count, of 5xx answers
    dropped: int = 0  # transport errors
    turns: int = 0  # answered turns (each one must be stored)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self, status: int, turns: int = 0) -> None:
        with self.lock:
            self.requests += 1
            if status >= 500:
                self.errors[status] = self.errors.get(status, 0) + 1
            elif 200 <= status < 300:
                self.turns += turns


def worker(proxy: ProxyProcess, tally: Tally, stop: threading.Event, seed: int) -> None:
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        long_key, long_messages = None, []
        step = 0
        while not stop.is_set():
            step += 1
            try:
                if long_key is None or len(long_messages) > 20:
                    long_key, long_messages = new_session(http, proxy, tally), []
                long_messages = long_turn(http, long_key, long_messages, seed, tally)
                episode(http, proxy, tally, step)
            except httpx.HTTPError:
                with tally.lock:
                    tally.dropped += 1


def new_session(http: httpx.Client, proxy: ProxyProcess, tally: Tally) -> tuple[str, str]:
    reply = http.post("/rl/sessions", json={"task_id": "soak"}, headers=proxy.admin)
    tally.answered(reply.status_code)
    assert reply.status_code == 201, reply.text
    body = reply.json()
    return body["api_key"], body["session_id"]


def long_turn(http, key: tuple[str, str], messages: list, seed: int, tally: Tally) -> list:
    messages = [*messages, {"role": "user", "content": f"Go on counting from {seed}."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8}
    reply = http.post("/v1/chat/completions", json=body, headers=bearer(key[0]))
    tally.answered(reply.status_code, turns=1)
    if reply.status_code != 200:
        return messages[:-1]
    said = reply.json()["choices"][0]["message"]["content"] or ""
    return [*messages, {"role": "assistant", "content": said}]


def episode(http: httpx.Client, proxy: ProxyProcess, tally: Tally, step: int) -> None:
    """A short session on one surface, rewarded and ended."""
    api_key, session_id = new_session(http, proxy, tally)
    headers = bearer(api_key)
    surface = step % 4
    user = {"role": "user", "content": f"Say something about {step}."}
    if surface == 0:
        body = {"model": "tiny", "messages": [user], "max_tokens": 8, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
            text = reply.read().decode()
        done = reply.status_code == 200 and "[DONE]" in text and '"error"' not in text
        tally.answered(reply.status_code if done or reply.status_code != 200 else 500, turns=1)
    elif surface == 1:
        body = {"model": "tiny", "input": user["content"], "max_output_tokens": 8}
        tally.answered(http.post("/v1/responses", json=body, headers=headers).status_code, 1)
    elif surface == 2:
        body = {"model": "tiny", "messages": [user], "max_tokens": 8}
        answer = http.post("/v1/messages", json=body, headers={"x-api-key": api_key})
        tally.answered(answer.status_code, turns=1)
    else:
        body = {"model": "tiny", "messages": [user], "max_tokens": 8, "n": 2}
        tally.answered(http.post("/v1/chat/completions", json=body, headers=headers).status_code, 2)
    reward = http.post(f"/rl/sessions/{session_id}/reward", json={"reward": 1.0}, headers=headers)
    tally.answered(reward.status_code)
    tally.answered(http.post(f"/rl/sessions/{session_id}/end", headers=headers).status_code)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, MB) samples, in MB per minute."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    covariance = sum((t - mean_t) * (m - mean_m) for t, m in samples)
    variance = sum((t - mean_t) ** 2 for t, _ in samples)
    return covariance / variance * 60


def test_slope_of_a_line_is_its_rate() -> None:
    assert slope_per_minute([(0, 10), (30, 11), (60, 12)]) == pytest.approx(2.0)


def test_rss_stays_flat_under_mixed_traffic(tiny_model_dir, tmp_path) -> None:
    data_dir = tmp_path / "data"
    with (
        EngineProcess(tiny_model_dir, tmp_path, "--num-threads", "1") as engine,
        ProxyProcess(tiny_model_dir, data_dir, "--engines", engine.url, *CACHE_FLAGS) as proxy,
    ):
        tally, stop = Tally(), threading.Event()
        threads = [
            threading.Thread(target=worker, args=(proxy, tally, stop, i), daemon=True)
            for i in range(WORKERS)
        ]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        samples: list[tuple[float, float]] = []
        try:
            while (elapsed := time.monotonic() - started) < SOAK_MINUTES * 60:
                if elapsed >= WARMUP_S:
                    samples.append((elapsed, rss_mb(proxy.process.pid)))
                    print(f"  {elapsed:6.0f} s  {samples[-1][1]:7.1f} MB  {tally.requests} req")
                time.sleep(SAMPLE_EVERY_S)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=90)
        # every answered turn is in the store (and nothing beyond: no request was left half-way)
        with sqlite3.connect(data_dir / "proxrl.db") as db:
            stored = db.execute("SELECT count(*) FROM turns").fetchone()[0]
    slope = slope_per_minute(samples)
    print(
        f"\nsoak {SOAK_MINUTES:g} min: {tally.requests} requests, 5xx {tally.errors}, "
        f"dropped {tally.dropped}, turns acknowledged {tally.turns} / stored {stored}; RSS "
        f"{samples[0][1]:.1f} -> {samples[-1][1]:.1f} MB after the warm-up, "
        f"slope {slope:+.2f} MB/min"
    )
    assert tally.errors == {} and tally.dropped == 0
    assert stored == tally.turns
    assert slope < MAX_SLOPE_MB_PER_MIN, f"RSS grows {slope:.2f} MB/min after the warm-up"
