"""What the serving layer around the devices costs: the CPU the HTTP proxies, ingress
replicas and worker replicas' host side spend per output token, and the ingress replicas
and cores a simulated cluster's token rate therefore needs (`kvserve simulate` prints it).

The figures are measured, not modelled: `python -m benchmarks.hostpath --write-serving-cost`
runs the whole Serve path at device speed (time dilation 1) on simulated devices and writes
the CPU seconds per output token of each kind of process, streamed (SSE) and not, into
cluster/sim/serving_cost.json. They are a property of the serving code and the CPU it ran
on, not of the device: the same per-token cost applies to any device's token rate.

    cores(kind)        = output tokens/s x cpu_s_per_token(kind, streamed)
    ingress replicas   = ceil(cores(ingress) / INGRESS_REPLICA_CORES)

An ingress replica runs one Python event loop: it uses at most about one core, and is
kept below that so that queueing inside it does not add to every request's latency.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).with_name("serving_cost.json")
KINDS = ("proxy", "ingress", "worker")
# The share of one core an ingress replica is planned to use.
INGRESS_REPLICA_CORES = 0.7


@dataclass(frozen=True)
class ServingCost:
    """CPU seconds per output token, per kind of process, streamed and not."""

    streamed: dict[str, float]
    plain: dict[str, float]
    source: str = ""

    @classmethod
    def load(cls, path: Path = DEFAULT_PATH) -> ServingCost:
        data = json.loads(path.read_text())
        return cls(dict(data["streamed"]), dict(data["plain"]), str(data.get("source", "")))

    def to_json(self) -> str:
        return json.dumps({"streamed": self.streamed, "plain": self.plain, "source": self.source}, indent=2) + "\n"

    def per_token(self, streamed: bool) -> dict[str, float]:
        return self.streamed if streamed else self.plain

    def plan(self, output_tokens_per_s: float, num_devices: int, streamed: bool = True) -> dict[str, Any]:
        """Cores per kind of process, their sum, ingress replicas, and cores per device."""
        cores = {kind: output_tokens_per_s * s for kind, s in self.per_token(streamed).items()}
        total = sum(cores.values())
        return {
            "cores": cores,
            "total_cores": total,
            "cores_per_device": total / max(num_devices, 1),
            "ingress_replicas": max(1, math.ceil(cores.get("ingress", 0.0) / INGRESS_REPLICA_CORES)),
            "us_per_token": 1e6 * sum(self.per_token(streamed).values()),
        }


def from_runs(runs: list[Any], source: str) -> ServingCost:
    """From benchmarks/hostpath_serve.py's runs: each kind's CPU over all tokens (a ratio of
    sums), streamed and not."""

    def ratio(selected: list[Any]) -> dict[str, float]:
        tokens = max(sum(r.tokens for r in selected), 1)
        return {kind: sum(r.cpu_s.get(kind, 0.0) for r in selected) / tokens for kind in KINDS}

    return ServingCost(ratio([r for r in runs if r.stream]), ratio([r for r in runs if not r.stream]), source)


def describe(plan: dict[str, Any], streamed: bool = True) -> str:
    cores = plan["cores"]
    return (f"serving layer ({'streamed' if streamed else 'not streamed'}, measured {plan['us_per_token']:.0f} us of "
            f"CPU per output token): {plan['total_cores']:.1f} cores = {plan['cores_per_device']:.2f} per device "
            f"(ingress {cores.get('ingress', 0):.1f} in {plan['ingress_replicas']} replicas, HTTP proxies "
            f"{cores.get('proxy', 0):.1f}, workers' host side {cores.get('worker', 0):.1f})")
