"""Ingress request metrics: a chunk of n tokens counts as n inter-token gaps, in one call."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from router.frontend.metrics import ITL_BUCKETS, IngressMetrics, observe_repeated


def samples(histogram: Histogram) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in histogram.collect() for s in metric.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("value", [0.0, 0.01, 0.0100001, 0.3, 79.9, 80.0, 1e6])
@pytest.mark.parametrize("count", [1, 7, 255])
def test_observe_repeated_leaves_what_count_observes_leave(value: float, count: int) -> None:
    one_by_one = Histogram("a", "a", buckets=ITL_BUCKETS, registry=CollectorRegistry())
    at_once = Histogram("a", "a", buckets=ITL_BUCKETS, registry=CollectorRegistry())
    for _ in range(count):
        one_by_one.observe(value)
    observe_repeated(at_once, value, count)
    assert samples(at_once) == pytest.approx(samples(one_by_one))


def test_a_chunk_counts_one_gap_per_token() -> None:
    metrics = IngressMetrics("m")
    metrics.observe_inter_token(0.06, 3)  # three gaps of 20 ms
    metrics.observe_inter_token(0.5, 0)  # no tokens: nothing observed
    got = samples(metrics.itl)
    label = (("model_name", "m"),)
    assert got[("kvserve:inter_token_latency_seconds_count", label)] == 3
    assert got[("kvserve:inter_token_latency_seconds_sum", label)] == pytest.approx(0.06)
    assert got[("kvserve:inter_token_latency_seconds_bucket", (("le", "0.01"), ("model_name", "m")))] == 0
    assert got[("kvserve:inter_token_latency_seconds_bucket", (("le", "0.025"), ("model_name", "m")))] == 3
