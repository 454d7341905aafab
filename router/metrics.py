"""Prometheus metrics served at the ingress's /metrics, named as vLLM names them
(`vllm:x` -> `kvserve:x`) so that existing dashboards need only a prefix change.

Two sources:
- Request metrics (latency histograms, token counters) are observed here at the ingress,
  per ingress replica, as outputs stream through it. With several ingress replicas a
  scrape through the Serve proxy reaches one of them; scrape each replica (or sum) for the
  whole picture.
- Engine metrics (running/waiting requests, KV usage, prefix-cache and preemption
  counters) come from the workers: on each scrape the ingress calls `stats` on EVERY
  worker replica with `DeploymentHandle.broadcast` (Serve 2.60) and renders one series
  per replica (label `replica`), plus cluster-wide aggregates under `kvserve:cluster_*`
  (separate names, so that `sum()` over the per-replica series never double counts).
  Disaggregated, both pools answer, each series labelled `pool` (prefill | decode).

Scraped per pod (the chart's ServiceMonitor: one target per pod with a Serve proxy), the
same source reaches Prometheus through several targets: every scrape carries every worker
replica's series, and a pod's proxy may hand the scrape to another pod's ingress replica.
So every series names its source, and a cluster-wide figure takes each source once before
summing over sources (the dashboard's `max by (<source>)`, tests/helm/test_dashboard_sums.py):
- worker series: `replica` (and `pool`); they are the same whichever ingress answered;
- everything this ingress replica answers carries `ingress_replica` (its Serve replica id),
  so that two targets that reached the same ingress replica are seen as one source.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class IngressMetrics:
    """Request-level metrics of one ingress replica, in its own registry."""

    def __init__(self, model_name: str, ingress_replica: str | None = None) -> None:
        self.model_name = model_name
        # The label every rendered series gets (None: none, for a single-process use).
        self.source_labels = {"ingress_replica": ingress_replica} if ingress_replica else {}
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token, at the ingress.", labels, registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between output tokens, at the ingress.", labels, registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "End-to-end request latency, at the ingress.", labels, registry=r, buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished engine requests.", labels, registry=r)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter("kvserve:request_success", "Finished engine requests.", labels + ["finished_reason"], registry=r)
        self.rejected = Counter("kvserve:requests_rejected", "HTTP requests refused (overload, limits).", labels + ["reason"], registry=r)
        self.migrations = Counter("kvserve:request_migrations", "Engine requests resumed on another replica after theirs died.", labels, registry=r)
        self.in_flight = Gauge("kvserve:ingress_requests_in_flight", "Requests (weighted by n) held by this ingress replica.", labels, registry=r)
        self.workers = WorkerStatsCollector(model_name)
        r.register(self.workers)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        h = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            h.observe(seconds / num_tokens)

    def observe_finished(self, seconds: float, num_prompt_tokens: int, num_output_tokens: int, reason: str | None) -> None:
        self.e2e.labels(self.model_name).observe(seconds)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(num_output_tokens)
        self.request_success.labels(self.model_name, reason or "unknown").inc()

    def render(self, worker_stats: list[dict[str, Any]]) -> bytes:
        # Synchronous from here to the end: a concurrent scrape cannot interleave.
        self.workers.latest = worker_stats
        return generate_latest(_Labelled(self.registry, self.source_labels))


# name, help, stats key, kind
_PER_REPLICA = (
    ("num_requests_running", "Requests in the worker's running batch.", "num_running", "gauge"),
    ("num_requests_waiting", "Requests waiting for KV blocks / a batch slot.", "num_waiting", "gauge"),
    ("kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = no free block).", "kv_usage", "gauge"),
    ("kv_cache_free_blocks", "Free KV blocks (evictable cached blocks included).", "free_blocks", "gauge"),
    ("kv_cache_total_blocks", "KV blocks in the pool.", "total_blocks", "gauge"),
    ("generation_tokens_per_second", "Worker decode throughput over the last seconds.", "tokens_per_s", "gauge"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries", "counter"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits", "counter"),
    ("num_preemptions", "Preemptions (a running request's blocks taken back).", "num_preemptions", "counter"),
)


class WorkerStatsCollector:
    """Renders the latest per-replica engine stats (set just before each render)."""

    def __init__(self, model_name: str, ingress_replica: str | None = None) -> None:
        self.model_name = model_name
        # The label every rendered series gets (None: none, for a single-process use).
        self.source_labels = {"ingress_replica": ingress_replica} if ingress_replica else {}
        self.latest: list[dict[str, Any]] = []

    def describe(self) -> list[Metric]:
        return []  # dynamic: nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        stats = self.latest
        # Disaggregated, replicas of two pools answer (router/workers.py tags each with its pool).
        pooled = any("pool" in s for s in stats)
        for name, doc, key, kind in _PER_REPLICA:
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(f"kvserve:{name}", doc, labels=["model_name", "replica"] + (["pool"] if pooled else []))
            for i, s in enumerate(stats):
                if key in s:
                    labels = [self.model_name, str(s.get("replica_id", i))] + ([str(s.get("pool", ""))] if pooled else [])
                    family.add_metric(labels, float(s[key]))
            yield family
        yield from self._aggregates(stats)

    def _aggregates(self, stats: list[dict[str, Any]]) -> Iterator[Metric]:
        def total(key: str) -> float:
            return float(sum(s.get(key, 0) for s in stats))

        labels = ["model_name"]
        value = [self.model_name]
        g = GaugeMetricFamily("kvserve:cluster_num_replicas", "Worker replicas that answered this scrape.", labels=labels)
        g.add_metric(value, len(stats))
        yield g
        for name, key in (("num_requests_running", "num_running"), ("num_requests_waiting", "num_waiting"),
                          ("kv_cache_free_blocks", "free_blocks"), ("kv_cache_total_blocks", "total_blocks")):
            g = GaugeMetricFamily(f"kvserve:cluster_{name}", f"Sum over worker replicas of kvserve:{name}.", labels=labels)
            g.add_metric(value, total(key))
            yield g
        blocks = total("total_blocks")
        g = GaugeMetricFamily("kvserve:cluster_kv_cache_usage_perc", "Used KV blocks / all KV blocks, over all replicas.", labels=labels)
        g.add_metric(value, 1.0 - total("free_blocks") / blocks if blocks else 0.0)
        yield g
        for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
            c = CounterMetricFamily(f"kvserve:cluster_{name}", f"Sum over worker replicas of kvserve:{name}.", labels=labels)
            c.add_metric(value, total(name))
            yield c


class _Labelled:
    """A registry's families with constant labels added to every sample (prometheus_client
    has no constant labels; `generate_latest` takes any object with `collect`)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if self.labels:
                family.samples = [Sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
                                  for s in family.samples]
            yield family
