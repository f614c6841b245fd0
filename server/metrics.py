"""The proxy's Prometheus metrics, served at ``GET /metrics``.

Two kinds of figures. Events are counted when they happen: each HTTP request (by method,
route template and status: the template, never the raw path, so ids do not explode the label
set), each store write batch, each weight swap. State is read when Prometheus scrapes: tokens
recorded, admission waits and refusals, each engine's health and load, sessions by run and
status (one GROUP BY on the store). Each app has its own registry, so two apps in one process
(tests) do not share counters. This module knows nothing about routes' meaning.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.engine_client.pool import parse_version
from server.store import runs as store_runs
from server.store import stats as store_stats

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from server.context import ServerContext

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
UNMATCHED = "unmatched"


class StateCollector(Collector):
    """Figures read from the running server at scrape time."""

    def __init__(self) -> None:
        self.ctx: ServerContext | None = None
        self.sessions: list[tuple[str, str, int]] = []  # run_id, status, count
        self.versions: list[tuple[str, int]] = []  # run_id, policy_version

    async def refresh(self) -> None:
        """Read the store's figures (called by the /metrics handler before rendering)."""
        if self.ctx is None:
            return
        async with self.ctx.sessionmaker() as db:
            self.sessions = await store_stats.sessions_by_run_and_status(db)
            self.versions = await store_runs.policy_versions(db)

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the context arrives at start-up

    def collect(self) -> Iterator[Metric]:
        ctx = self.ctx
        if ctx is None:
            return
        stats = ctx.writer.stats
        tokens = CounterMetricFamily(
            "proxrl_tokens", "Tokens served and recorded, by kind.", labels=["kind"]
        )
        tokens.add_metric(["prompt"], stats.prompt_tokens)
        tokens.add_metric(["completion"], stats.completion_tokens)
        yield tokens
        yield CounterMetricFamily("proxrl_turns", "Turns (completions) recorded.", stats.turns)
        yield CounterMetricFamily(
            "proxrl_admission_waits",
            "Session creations that waited at the staleness bound.",
            ctx.admission.waits,
        )
        yield CounterMetricFamily(
            "proxrl_admission_refusals",
            "Session creations refused with 429 at the staleness bound.",
            ctx.admission.refusals,
        )
        yield from self._engines(ctx)
        sessions = GaugeMetricFamily(
            "proxrl_sessions", "Sessions by run and status.", labels=["run_id", "status"]
        )
        for run_id, status, count in self.sessions:
            sessions.add_metric([run_id, status], count)
        yield sessions
        versions = GaugeMetricFamily(
            "proxrl_policy_version", "The policy version each run serves.", labels=["run_id"]
        )
        for run_id, version in self.versions:
            versions.add_metric([run_id], version)
        yield versions
        yield GaugeMetricFamily(
            "proxrl_start_time_seconds", "When the server started (unix time).", ctx.started_at
        )
        yield GaugeMetricFamily(
            "proxrl_leader",
            "1 while this replica leads (swaps weights, judges the engines' versions).",
            1.0 if ctx.pool.leading else 0.0,
        )

    def _engines(self, ctx: ServerContext) -> Iterator[Metric]:
        def family(kind: type, name: str, doc: str) -> Any:
            return kind(name, doc, labels=["url"])

        healthy = family(GaugeMetricFamily, "proxrl_engine_healthy", "1 while in rotation.")
        in_flight = family(
            GaugeMetricFamily, "proxrl_engine_in_flight", "Requests in flight to the engine."
        )
        version = family(
            GaugeMetricFamily, "proxrl_engine_weight_version", "The weight version it serves."
        )
        served = family(
            CounterMetricFamily, "proxrl_engine_served_tokens", "Tokens the engine sampled."
        )
        failures = family(
            CounterMetricFamily, "proxrl_engine_failures", "Times it left the rotation."
        )
        for engine in ctx.pool.engines:
            healthy.add_metric([engine.url], 1.0 if engine.healthy else 0.0)
            in_flight.add_metric([engine.url], engine.in_flight)
            if engine.weight_version is not None:
                version.add_metric([engine.url], parse_version(engine.weight_version))
            served.add_metric([engine.url], engine.served_tokens)
            failures.add_metric([engine.url], engine.failures)
        yield from (healthy, in_flight, version, served, failures)


class Metrics:
    """The registry and the event metrics of one app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["method", "route", "status"]
        self.requests = Counter(
            "proxrl_http_requests", "HTTP requests answered.", labels, registry=self.registry
        )
        self.request_seconds = Histogram(
            "proxrl_http_request_duration_seconds",
            "Time from a request's arrival to its last byte (streams included).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_progress = Gauge(
            "proxrl_http_requests_in_progress", "Requests being answered.", registry=self.registry
        )
        self.store_write_seconds = Histogram(
            "proxrl_store_write_seconds",
            "Time to commit one batch of turns to the store.",
            buckets=WRITE_BUCKETS,
            registry=self.registry,
        )
        self.weight_swap_pause_seconds = Histogram(
            "proxrl_weight_swap_pause_seconds",
            "How long generation was paused for each weight swap (its count: the swaps).",
            buckets=PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.malformed_tool_calls = Counter(
            "proxrl_malformed_tool_calls",
            "<tool_call> blocks in served completions that were not calls (left as text).",
            ["surface"],
            registry=self.registry,
        )
        self.hosted_tools_omitted = Counter(
            "proxrl_hosted_tools_omitted",
            "Hosted tools (web_search, tool_search, ...) left out of Responses prompts by the "
            "run's hosted_tools policy, by tool type.",
            ["type"],
            registry=self.registry,
        )
        self.state = StateCollector()
        self.registry.register(self.state)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        labels = (method, route, str(status))
        self.requests.labels(*labels).inc()
        self.request_seconds.labels(*labels).observe(seconds)


class RequestMetrics:
    """ASGI middleware: time every HTTP request to its last byte, by route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_progress.inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.in_progress.dec()
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            elapsed = time.perf_counter() - started
            self.metrics.observe_request(scope["method"], route, status, elapsed)
