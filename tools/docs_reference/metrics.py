"""``reference/metrics.md``: every Prometheus metric ``GET /metrics`` serves.

Read from the proxy's own registry (``server.metrics.Metrics``): every family it yields, the
scrape-time collector's given a stand-in server state to read (one engine, one run: every
family and label shows, no figure means anything). The
embedded engine and the trainer export no Prometheus metrics (the trainer's figures go to
``metrics.jsonl``, the server and its trackers). Knows nothing of what a metric counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector, CollectorRegistry

from server.metrics import UNMATCHED, Metrics, StateCollector
from server.store.writer import WriterStats
from tools.docs_reference import markdown as md

SOURCES = ["server/metrics.py"]


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    help: str
    series: list[str]  # the names it is exposed under (_total, _bucket, _sum, _count, ...)
    labels: list[str]
    buckets: list[str]  # a histogram's upper bounds


def give_children(registry: CollectorRegistry) -> None:
    """One child for each labelled metric of ``registry`` that has none, so that its labels show
    in what it yields (prometheus_client lists neither collectors nor label names publicly)."""
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase) and collector._labelnames:
            collector.labels(*collector._labelnames)


def give_stand_in_state(collector: StateCollector) -> None:
    """A stand-in server state of one engine and one run for the scrape-time collector."""
    engine = SimpleNamespace(
        url="URL", healthy=True, in_flight=0, weight_version="0", served_tokens=0, failures=0
    )
    collector.ctx = SimpleNamespace(  # type: ignore[assignment]
        writer=SimpleNamespace(stats=WriterStats()),
        admission=SimpleNamespace(waits=0, refusals=0),
        pool=SimpleNamespace(engines=[engine], leading=True),
        started_at=0.0,
    )
    collector.sessions, collector.versions = [("RUN", "STATUS", 0)], [("RUN", 0)]


def families(collector: Collector | CollectorRegistry) -> list[Family]:
    found = []
    for family in collector.collect():
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        labels = {name: None for s in samples for name in s.labels if name != "le"}
        buckets = [s.labels["le"] for s in samples if "le" in s.labels]
        found.append(
            Family(
                name=family.name,
                type=family.type,
                help=family.documentation,
                series=list(dict.fromkeys(s.name for s in samples)) or [family.name],
                labels=list(labels),
                buckets=list(dict.fromkeys(buckets)),
            )
        )
    return found


def _rows(found: Iterable[Family]) -> list[list[str]]:
    return [
        [
            "<br>".join(md.code(s) for s in f.series),
            f.type,
            ", ".join(md.code(label) for label in f.labels) or "—",
            md.text(f.help) + (f" Buckets (s): {', '.join(f.buckets)}." if f.buckets else ""),
        ]
        for f in found
    ]


def render(events: list[Family], state: list[Family]) -> str:
    intro = (
        "`proxrl serve` serves these at `GET /metrics` in Prometheus' text format: open to "
        "anyone while it binds a loopback address, otherwise behind the admin key as a bearer "
        "token. No `*_created` series are served. The embedded engine and the trainer export "
        "no Prometheus metrics (the trainer's figures go to its `metrics.jsonl`, the server and "
        "the [trackers](config.md#tracking))."
    )
    headers = ["Series", "Type", "Labels", "Help"]
    return md.join(
        [
            md.head("Metrics", SOURCES, intro),
            "## Events",
            "Counted when they happen. `route` is the route's template (`/rl/runs/{run_id}`), "
            "never the raw path; a request no route matched counts as " + md.code(UNMATCHED) + ".",
            md.table(headers, _rows(events)),
            "## State",
            "Read from the running server (and one query of the store) at each scrape. `url` "
            "is an engine's base URL, `run_id` a run's id.",
            md.table(headers, _rows(state)),
        ]
    )


def page(metrics: Metrics | None = None) -> str:
    """The page of ``metrics`` (default: a new app's): every family its registry yields, the
    scrape-time collector's apart."""
    metrics = metrics or Metrics()
    give_children(metrics.registry)
    give_stand_in_state(metrics.state)
    state = families(metrics.state)
    read_at_scrape = {family.name for family in state}
    events = [f for f in families(metrics.registry) if f.name not in read_at_scrape]
    return render(events, state)
