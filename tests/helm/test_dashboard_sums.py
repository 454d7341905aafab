"""The Grafana dashboard's cluster-wide figures add up when Prometheus scrapes every pod.

The chart's ServiceMonitor scrapes /metrics on every pod behind the HTTP Service (one
Serve proxy each); each proxy hands the scrape to an ingress replica, which renders its own
request metrics and the engine stats of EVERY worker replica (router/frontend/metrics.py). Summed
naively over targets, every worker's queue would count once per pod.

Here the chart is rendered by the real Helm engine; the dashboard's queries are taken from
the rendered ConfigMap; the targets, their path and the labels Prometheus attaches (job,
namespace, service, endpoint, pod, instance) from the rendered ServiceMonitor and Service;
each pod's scrape is the real /metrics text of kvserve's metrics code (one IngressMetrics
per ingress replica, with the engine stats of real engines: worker/engine/core.py over a
model-free runner). The queries are evaluated (tests/helm/promql.py) over the scraped
samples and must equal the same queries over ONE source that saw everything: one ingress
that served every request, scraped once.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.frontend.metrics import IngressMetrics
from tests.support.fake_runner import TOKEN, VOCAB, FakeRunner
from tests.helm.chart import NAMESPACE, Rendered
from tests.helm.promql import STALE, Evaluator, Series, parse
from worker.api import SamplingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "m"
NUM_ROUNDS = 5  # scrapes at 0, interval, ..., 4 intervals (one $__rate_interval window)
NUM_WORKERS = 3


# ----------------------------------------------------------------------------- the chart


@dataclass(frozen=True)
class ScrapeConfig:
    """What the rendered ServiceMonitor and Service make Prometheus do."""

    interval_s: float
    path: str
    job: str  # the Service's name (Prometheus operator's default job label)
    endpoint: str  # the port name
    num_pods: int  # endpoints of the Service: the ingress group's pods


def scrape_config(r: Rendered) -> ScrapeConfig:
    (monitor,) = [m for m in r.kind("ServiceMonitor") if not m["metadata"]["name"].endswith("-ray")]
    (endpoint,) = monitor["spec"]["endpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in r.kind("Service") if selector.items() <= s["metadata"]["labels"].items()]
    values = r.effective_values
    assert values["ingressGroup"]["enabled"], "this scenario's Service selects the ingress group's pods"
    assert endpoint["interval"].endswith("s")
    return ScrapeConfig(float(endpoint["interval"][:-1]), endpoint["path"], service["metadata"]["name"],
                        endpoint["port"], int(values["ingressGroup"]["replicas"]))


def dashboard_queries(r: Rendered, rate_interval: str) -> dict[str, str]:
    """'panel title / legend' -> expr, with Grafana's variables as a Grafana would fill them
    ($model: All -> its allValue; $__rate_interval: the given window)."""
    (cm,) = [c for c in r.kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    dashboard = json.loads(cm["data"]["kvserve.json"])
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    out = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$model", model["allValue"])
            out[f"{panel['title']} / {target.get('legendFormat', '')}"] = expr
    return out


# ----------------------------------------------------------------------------- the sources


class Workers:
    """Real engines (scheduler, KV pool, waiting queue) over a model-free runner: their
    stats are the dicts WorkerReplica.stats returns to the ingress."""

    def __init__(self) -> None:
        self.engines = [
            Engine(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256),
                   CacheConfig(block_size=16, num_blocks_override=12), FakeRunner(12, TOKEN, vocab_size=VOCAB), VOCAB)
            for _ in range(NUM_WORKERS)
        ]
        self.num_requests = 0

    def load(self, rng: random.Random) -> None:
        for engine in self.engines:
            for _ in range(rng.randint(1, 4)):
                self.num_requests += 1
                prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 60))]
                engine.add_request(f"r{self.num_requests}", prompt, SamplingParams(max_tokens=rng.randint(8, 40)))
            for _ in range(rng.randint(2, 12)):
                engine.step()

    def stats(self) -> list[dict[str, Any]]:
        return [{**e.stats().to_dict(), "replica_id": f"worker#{i}"} for i, e in enumerate(self.engines)]


def serve_requests(rng: random.Random, ingresses: list[IngressMetrics], truth: IngressMetrics) -> None:
    """One round of requests: each lands on one ingress replica (unevenly) and on the
    single source of truth."""
    for _ in range(rng.randint(5, 15)):
        i = 0 if rng.random() < 0.7 else 1
        ttft, itl, n = rng.lognormvariate(-2, 1), rng.lognormvariate(-4, 0.5), rng.randint(1, 50)
        prompt, reason = rng.randint(10, 2000), rng.choice(["stop", "length"])
        for m in (ingresses[i], truth):
            m.observe_first_token(ttft)
            m.observe_inter_token(itl * n, n)
            m.observe_finished(ttft + itl * n, prompt, n, reason)


# ----------------------------------------------------------------------------- Prometheus

# The labels the Prometheus operator gives a ServiceMonitor endpoint's targets.
TargetLabels = dict[str, str]


class Prometheus:
    """Stores scraped samples as Prometheus does: one series per target and label set,
    the target's labels attached (honor_labels false: a clash keeps the scraped value as
    exported_<name>); a series missing from its target's next scrape gets a staleness
    marker."""

    def __init__(self) -> None:
        self.series: dict[frozenset[tuple[str, str]], Series] = {}
        self.last_scrape: dict[str, set[frozenset[tuple[str, str]]]] = {}  # instance -> series keys

    def scrape(self, t: float, target: TargetLabels, text: str) -> None:
        seen: set[frozenset[tuple[str, str]]] = set()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {"__name__": sample.name, **sample.labels}
                for k, v in target.items():
                    if k in labels:
                        labels[f"exported_{k}"] = labels[k]
                    labels[k] = v
                key = frozenset(labels.items())
                self.series.setdefault(key, Series(labels)).samples.append((t, float(sample.value)))
                seen.add(key)
        for gone in self.last_scrape.get(target["instance"], set()) - seen:
            self.series[gone].samples.append((t, STALE))
        self.last_scrape[target["instance"]] = seen

    def evaluator(self) -> Evaluator:
        return Evaluator(list(self.series.values()))


def target_labels(config: ScrapeConfig, pod: str, index: int) -> TargetLabels:
    return {"job": config.job, "namespace": NAMESPACE, "service": config.job, "endpoint": config.endpoint,
            "pod": pod, "instance": f"10.0.0.{index + 10}:8000", "container": "ray-worker"}


def run(config: ScrapeConfig, route: Callable[[int, int], int], num_extra_targets: int = 0) -> tuple[Prometheus, Prometheus, float]:
    """Simulates NUM_ROUNDS scrapes of the cluster (config.num_pods ingress pods, plus extra
    targets) and of the single source. `route(pod, round)` -> the ingress replica that
    pod's proxy hands the scrape to. Returns (cluster, truth, evaluation time)."""
    rng = random.Random(15)
    workers = Workers()
    ingresses = [IngressMetrics(MODEL, ingress_replica=f"ingress#{i}") for i in range(config.num_pods)]
    truth_source = IngressMetrics(MODEL)
    cluster, truth = Prometheus(), Prometheus()
    pods = [f"kvs-kvserve-ingress-{i}" for i in range(config.num_pods + num_extra_targets)]
    for round_ in range(NUM_ROUNDS):
        serve_requests(rng, ingresses, truth_source)
        workers.load(rng)
        t = round_ * config.interval_s
        stats = workers.stats()  # every ingress replica's broadcast sees the same engines
        for p, pod in enumerate(pods):
            body = ingresses[route(p, round_)].render(stats).decode()
            cluster.scrape(t, target_labels(config, pod, p), body)
        truth.scrape(t, target_labels(config, "the-one-source", 0), truth_source.render(stats).decode())
    return cluster, truth, (NUM_ROUNDS - 1) * config.interval_s


def rate_window(config: ScrapeConfig) -> str:
    # Grafana's $__rate_interval at this resolution: 4 scrape intervals; 1 ms more so that
    # Prometheus's left-open range holds the window's first scrape too.
    return f"{int(4 * config.interval_s * 1000) + 1}ms"


def same(a: Any, b: Any) -> bool:
    return a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-3) for k in a)


def pretty(vector: Any) -> dict[str, float]:
    return {",".join(f"{k}={v}" for k, v in sorted(key)): value for key, value in vector.items()}


# ----------------------------------------------------------------------------- the tests


def test_dashboard_figures_equal_the_single_source(rendered: dict[str, Rendered]) -> None:
    """The chart's topology: one target per ingress-group pod, each pod's proxy hands the
    scrape to its own ingress replica (Serve prefers the local replica)."""
    r = rendered["everything_on"]  # the ServiceMonitor and the dashboard on
    config = scrape_config(r)
    assert config.num_pods >= 2 and config.path.endswith("/metrics")
    cluster, truth, at = run(config, route=lambda pod, _: pod)
    queries = dashboard_queries(r, rate_window(config))
    scraped_names = {s.labels["__name__"] for s in truth.series.values()}
    evaluated = 0
    for name, expr in queries.items():
        parse(expr)  # every query is inside the evaluator's subset (else: ParseError)
        got, want = cluster.evaluator().query(expr, at), truth.evaluator().query(expr, at)
        assert same(got, want), f"{name}: {expr}\n  cluster {pretty(got)}\n  truth   {pretty(want)}"
        if any(n in expr for n in scraped_names):
            assert want, f"{name}: {expr} is empty over the simulated scrapes"
            evaluated += 1
    assert evaluated >= 10, evaluated


def test_worker_panels_hold_with_a_proxy_on_every_node(rendered: dict[str, Rendered]) -> None:
    """With a proxy on every pod in the Service (ingressGroup off), a pod that hosts no
    ingress replica answers each scrape from whichever replica its proxy picks: the worker
    panels still add up (each worker replica counted once)."""
    r = rendered["everything_on"]
    config = scrape_config(r)
    cluster, truth, at = run(config, route=lambda pod, round_: pod if pod < config.num_pods else round_ % config.num_pods,
                             num_extra_targets=1)
    worker_panels = {n: q for n, q in dashboard_queries(r, rate_window(config)).items()
                     if "num_requests" in q or "kv_cache" in q or "preemptions" in q}
    assert len(worker_panels) >= 4
    for name, expr in worker_panels.items():
        got, want = cluster.evaluator().query(expr, at), truth.evaluator().query(expr, at)
        assert want and same(got, want), f"{name}: {expr}\n  cluster {pretty(got)}\n  truth   {pretty(want)}"


def test_naive_sums_count_every_worker_once_per_pod(rendered: dict[str, Rendered]) -> None:
    """What the dashboard must not do: summing the scraped series over targets multiplies
    every worker's queue by the number of pods (the evaluator and scrape see it)."""
    config = scrape_config(rendered["everything_on"])
    cluster, truth, at = run(config, route=lambda pod, _: pod)
    naive = 'sum(kvserve:num_requests_running{model_name=~".*"})'
    got, want = cluster.evaluator().query(naive, at), truth.evaluator().query(naive, at)
    (value,) = want.values()
    assert value > 0
    assert list(got.values()) == [pytest.approx(config.num_pods * value)]
    # One ingress replica per pod, each scraped once: a sum over ingress series is right.
    tokens = f'sum(rate(kvserve:generation_tokens_total[{rate_window(config)}]))'
    assert same(cluster.evaluator().query(tokens, at), truth.evaluator().query(tokens, at))


def test_ray_metrics_are_scraped_once_per_pod(rendered: dict[str, Rendered]) -> None:
    """The autoscaling decisions (ray_kvserve_autoscaling_*) come from Ray's metrics agent:
    a second ServiceMonitor scrapes it on every Ray pod through a headless Service (one
    target per pod, each process on exactly one), on the port every pod exports on, open
    to Prometheus's namespace only."""
    r = rendered["everything_on"]
    monitor = next(m for m in r.kind("ServiceMonitor") if m["metadata"]["name"].endswith("-ray"))
    selector = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in r.kind("Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert service["spec"]["clusterIP"] == "None"
    assert "app.kubernetes.io/component" not in service["spec"]["selector"]  # every Ray pod, head included
    (port,) = service["spec"]["ports"]
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {g["rayStartParams"]["metrics-export-port"] for g in groups} == {str(port["port"])}
    (policy,) = r.kind("NetworkPolicy")
    metrics_rules = [rule for rule in policy["spec"]["ingress"]
                     if rule.get("ports") == [{"port": port["port"], "protocol": "TCP"}]]
    assert [[f["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for f in rule["from"]]
            for rule in metrics_rules] == [["monitoring"]]
    assert not [s for s in rendered["default"].kind("Service") if s["metadata"]["name"].endswith("-ray-metrics")]
