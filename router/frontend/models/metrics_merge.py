"""/metrics of an ingress replica serving several models: each model's registry
(router/frontend/metrics.py's IngressMetrics, every series labelled with its model_name)
rendered as one exposition, each family once with the samples of every model (the text
format allows a family's HELP and TYPE once)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric

from router.frontend.metrics import IngressMetrics, labelled


class _Merged:
    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        yield from families.values()


def render_models(metrics: Sequence[IngressMetrics], worker_stats: Sequence[list[dict[str, Any]]]) -> bytes:
    """Each model's metrics with its workers' latest stats, as one exposition."""
    for m, stats in zip(metrics, worker_stats):
        m.workers.latest = stats
    return generate_latest(_Merged([labelled(m) for m in metrics]))
