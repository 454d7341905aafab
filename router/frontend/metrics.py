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

Router and admission metrics (per ingress replica: each runs its own request router):
- admission (router/routing/admission.py): `kvserve:ingress_queue_time_seconds` (time held before
  going to a worker; 0 for requests that went at once), `kvserve:ingress_queue_length`,
  `kvserve:admission_decisions{reason}` (fits / full / stale / no_router / idle / off / overtakes) and
  sheds under `kvserve:requests_rejected{reason="admission_queue_full"|"admission_queue_timeout"}`;
- prefix hits: `kvserve:router_prefix_hit_tokens_predicted` (at admission, the prompt
  tokens the best-placed replica reports cached, counted while stats are fresh) against
  `kvserve:router_prefix_hit_tokens_realised` (what the engine served from its cache, from
  each engine request's first output): the gap is locality that routing gave up (load
  spreading) or that was evicted between the report and the admission;
- the request router itself, read at each scrape from the router in this process
  (router/routing/serve_router.py): `kvserve:router_decisions{mode}`
  (affinity / spread / headroom / load_gate / pow2 / a policy's mode), and per replica
  `kvserve:router_requests_outstanding`, `kvserve:router_reservations_unreflected`
  (dispatches no report shows yet) and `kvserve:router_stats_age_seconds`.
"""
from __future__ import annotations

import bisect

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def observe_repeated(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value`, as `count` calls of `histogram.observe(value)` would
    leave it, at the cost of one: a non-streamed answer brings all its tokens at once, and
    observing each of them on its own costs a lock round trip per token. `histogram` is one
    labelled child (prometheus_client keeps its buckets as per-bucket counts, the last
    bound +Inf; the rendered cumulative counts are summed at scrape time)."""
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(count)


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
        self.queue_time = Histogram("kvserve:ingress_queue_time_seconds", "Time a request was held by admission control before going to a worker.", labels, registry=r, buckets=QUEUE_BUCKETS)
        self.queue_length = Gauge("kvserve:ingress_queue_length", "Requests held by admission control on this ingress replica.", labels, registry=r)
        self.admission = Counter("kvserve:admission_decisions", "Requests let through by admission control, by why they could go.", labels + ["reason"], registry=r)
        self.prefix_predicted = Counter("kvserve:router_prefix_hit_tokens_predicted", "Prompt tokens the best-placed replica reported cached at admission (fresh stats only).", labels, registry=r)
        self.prefix_realised = Counter("kvserve:router_prefix_hit_tokens_realised", "Prompt tokens the engine served from its prefix cache.", labels, registry=r)
        self.limit_store = Gauge("kvserve:limit_store_up", "1 while the shared per-key limit store (Redis) answers, 0 while this replica counts alone.", labels, registry=r)
        self.limit_local = Counter("kvserve:limit_store_local_decisions", "Per-key limit decisions made from this replica's counts because the shared store did not answer.", labels + ["kind"], registry=r)
        for series in (self.queue_length, self.prefix_predicted, self.prefix_realised):
            series.labels(model_name)  # shown at 0 from the start (dashboards divide by them)
        self.workers = WorkerStatsCollector(model_name)
        r.register(self.workers)
        self.router = RouterStatsCollector(model_name)
        r.register(self.router)

    def observe_first_token(self, seconds: float, num_cached_tokens: int = 0) -> None:
        self.ttft.labels(self.model_name).observe(seconds)
        if num_cached_tokens:
            self.prefix_realised.labels(self.model_name).inc(num_cached_tokens)

    # -- admission control (router/routing/admission.py's AdmissionMetrics) ----------------------
    def observe_admitted(self, wait_s: float, reason: str, predicted_cached_tokens: int) -> None:
        self.queue_time.labels(self.model_name).observe(wait_s)
        self.admission.labels(self.model_name, reason).inc()
        if predicted_cached_tokens:
            self.prefix_predicted.labels(self.model_name).inc(predicted_cached_tokens)

    def observe_shed(self, reason: str) -> None:
        self.rejected.labels(self.model_name, f"admission_{reason}").inc()

    # -- the shared limit store (cluster/state_store.py's StoreObserver) -------------------------
    def limit_store_up(self, up: bool) -> None:
        self.limit_store.labels(self.model_name).set(1 if up else 0)

    def limit_decided_locally(self, kind: str) -> None:
        self.limit_local.labels(self.model_name, kind).inc()

    def set_queue_length(self, length: int) -> None:
        self.queue_length.labels(self.model_name).set(length)

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        """A chunk of `num_tokens` tokens `seconds` after the previous one: that many gaps of
        seconds / num_tokens each."""
        if num_tokens > 0:
            observe_repeated(self.itl.labels(self.model_name), seconds / num_tokens, num_tokens)

    def observe_finished(self, seconds: float, num_prompt_tokens: int, num_output_tokens: int, reason: str | None) -> None:
        self.e2e.labels(self.model_name).observe(seconds)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(num_output_tokens)
        self.request_success.labels(self.model_name, reason or "unknown").inc()

    def render(self, worker_stats: list[dict[str, Any]]) -> bytes:
        # Synchronous from here to the end: a concurrent scrape cannot interleave.
        self.workers.latest = worker_stats
        return generate_latest(labelled(self))


def labelled(metrics: IngressMetrics) -> _Labelled:
    """The replica's registry with its source labels on every sample (what render writes)."""
    return _Labelled(metrics.registry, metrics.source_labels)


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
    ("spec_decode_num_draft_tokens", "Speculative draft tokens verified.", "num_draft_tokens", "counter"),
    ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", "num_accepted_draft_tokens",
     "counter"),
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
        # Disaggregated, replicas of two pools answer (router/frontend/workers.py tags each with its pool).
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


class RouterStatsCollector:
    """The request router of this ingress replica, read at each scrape. `source` returns it
    (router/serve_internals.py's initialized_request_router_of on the worker handle; None
    until Serve created it, or for Serve's own router, which has no counters to show)."""

    def __init__(self, model_name: str, source: Callable[[], Any] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.model_name = model_name
        self.source = source
        self._clock = clock

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        router = self.source() if self.source is not None else None
        if router is None:
            return
        labels = ["model_name"]
        modes = _copy(lambda: dict(getattr(router, "num_decisions_by_mode", {}) or {}))
        c = CounterMetricFamily("kvserve:router_decisions", "Routing decisions of this ingress's router, by mode.", labels=labels + ["mode"])
        for mode, count in sorted((modes or {}).items()):
            c.add_metric([self.model_name, str(mode)], float(count))
        yield c
        view_of = getattr(router, "routing_view", None)
        view = view_of() if callable(view_of) else {}
        now = self._clock()
        families = {
            "outstanding": GaugeMetricFamily("kvserve:router_requests_outstanding", "Requests this router sent to the replica that have not completed.", labels=labels + ["replica"]),
            "unreflected_requests": GaugeMetricFamily("kvserve:router_reservations_unreflected", "Requests this router dispatched to the replica that no report shows yet.", labels=labels + ["replica"]),
            "stats_age": GaugeMetricFamily("kvserve:router_stats_age_seconds", "Age of the replica's last routing-stats report as this router holds it.", labels=labels + ["replica"]),
        }
        for replica, entry in sorted(view.items()):
            key = [self.model_name, str(replica)]
            for name in ("outstanding", "unreflected_requests"):
                if name in entry:
                    families[name].add_metric(key, float(entry[name]))
            timestamp = (entry.get("stats") or {}).get("timestamp")
            if isinstance(timestamp, (int, float)):
                families["stats_age"].add_metric(key, max(now - float(timestamp), 0.0))
        yield from families.values()


def _copy(read: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """A copy of a dict the router thread may be changing (retried when it changed size)."""
    for _ in range(3):
        try:
            return read()
        except RuntimeError:
            continue
    return None
