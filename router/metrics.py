"""The router's Prometheus metrics (one registry per router), rendered in the text format for /metrics.

Latencies, queue depth, routing decisions, migrations, rejections; per-worker load is read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from contract.wire import pb
from router.registry import Registry

PREFIX = "q3vl_router"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _WorkerLoadCollector(Collector):
    """Per-worker gauges computed from the registry when scraped (no bookkeeping on the hot path)."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "inflight": ("requests this router has in flight on the worker", lambda e: e.inflight),
            "booked_prefill_tokens": ("prompt tokens booked and not yet prefilled", lambda e: e.booked_prefill_tokens),
            "booked_kv_blocks": ("KV blocks booked by this router", lambda e: e.booked_blocks),
            "active_kv_blocks": ("KV blocks in use (last report)", lambda e: e.report.active_kv_blocks),
            "queued_prompt_tokens": ("prompt tokens waiting (last report)", lambda e: e.report.queued_prompt_tokens),
            "running_requests": ("running requests (last report)", lambda e: e.report.running_requests),
            "healthy": ("1 if the worker gets new work", lambda e: int(e.healthy)),
        }
        for name, (doc, read) in families.items():
            family = GaugeMetricFamily(f"{PREFIX}_worker_{name}", doc, labels=["worker", "role"])
            for entry in self._registry.entries():
                family.add_metric([entry.worker_id, pb.WorkerRole.Name(entry.role)], read(entry))
            yield family


class RouterMetrics:
    def __init__(self, registry: Registry, queue_depth: Callable[[], int], inflight: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "admitted requests by how they ended: STOP (EOS, a stop token or a stop string), "
            "LENGTH, ABORT, ERROR, CANCELLED (the caller went away)", ["outcome"], registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "mean gap per token between chunks",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds", "arrival to the request's end", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.decisions = Counter(f"{PREFIX}_routing_decisions", "picks by worker and stage", ["worker", "stage"], registry=r)
        self.migrations = Counter(f"{PREFIX}_migrations", "requests replayed on another worker", ["kind"], registry=r)
        self.rejections = Counter(f"{PREFIX}_rejections", "requests refused at admission", ["reason"], registry=r)
        self.prefill_mode = Counter(f"{PREFIX}_prefill", "where prompts were prefilled", ["mode"], registry=r)
        queue_gauge = Gauge(f"{PREFIX}_queue_depth", "requests waiting for admission", registry=r)
        queue_gauge.set_function(queue_depth)
        inflight_gauge = Gauge(f"{PREFIX}_inflight_requests", "requests admitted and not finished", registry=r)
        inflight_gauge.set_function(inflight)
        r.register(_WorkerLoadCollector(registry))
        self._children: dict[tuple[int, tuple[str, ...]], Counter] = {}

    def count(self, counter: Counter, *labels: str) -> None:
        """counter.labels(*labels).inc(), with the labelled child looked up once (labels() takes the metric's lock
        and checks its arguments on every call)."""
        key = (id(counter), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(*labels)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> str:
        """One line of totals for the router's log at shutdown, e.g. 'requests finished=120 error=1; migrations 3'."""
        parts = []
        for counter, label in ((self.requests, "requests"), (self.migrations, "migrations"), (self.rejections, "rejections")):
            totals = {
                sample.labels.get(next(iter(sample.labels), ""), ""): int(sample.value)
                for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total")
            }
            parts.append(f"{label} " + (" ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "0"))
        return "; ".join(parts)
