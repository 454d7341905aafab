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

Two sets of figures: through Serve's HTTP proxies (kvserve's default), and through Serve's
direct ingress (`kvserve serve --direct-ingress`: HAProxy in place of the proxies, whose
CPU the "proxy" kind then counts), written when the benchmark ran that path too
(`--direct-ingress`); `kvserve simulate --direct-ingress` plans with the second.

An ingress replica runs one Python event loop: it uses at most about one core, and is
kept below that so that queueing inside it does not add to every request's latency.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
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
    direct_ingress: ServingCost | None = None  # the same figures through direct ingress

    @classmethod
    def load(cls, path: Path = DEFAULT_PATH) -> ServingCost:
        data = json.loads(path.read_text())
        direct = data.get("direct_ingress")
        return cls(dict(data["streamed"]), dict(data["plain"]), str(data.get("source", "")),
                   cls(dict(direct["streamed"]), dict(direct["plain"])) if direct is not None else None)

    def to_json(self) -> str:
        data: dict[str, Any] = {"streamed": self.streamed, "plain": self.plain, "source": self.source}
        if self.direct_ingress is not None:
            data["direct_ingress"] = {"streamed": self.direct_ingress.streamed, "plain": self.direct_ingress.plain}
        return json.dumps(data, indent=2) + "\n"

    def path(self, direct_ingress: bool) -> ServingCost:
        """The figures of one front door: Serve's proxies, or direct ingress."""
        if not direct_ingress:
            return self
        if self.direct_ingress is None:
            raise ValueError("no direct-ingress figures measured: run `python -m benchmarks.hostpath "
                             "--direct-ingress --write-serving-cost`")
        return self.direct_ingress

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


def from_runs(runs: list[Any], source: str, direct_runs: list[Any] | None = None) -> ServingCost:
    """From benchmarks/hostpath_serve.py's runs: each kind's CPU over all tokens (a ratio of
    sums), streamed and not; `direct_runs`: those through direct ingress, if it ran."""

    def ratio(selected: list[Any]) -> dict[str, float]:
        tokens = max(sum(r.tokens for r in selected), 1)
        return {kind: sum(r.cpu_s.get(kind, 0.0) for r in selected) / tokens for kind in KINDS}

    def cost(selected: list[Any]) -> ServingCost:
        return ServingCost(ratio([r for r in selected if r.stream]), ratio([r for r in selected if not r.stream]))

    direct = cost(direct_runs) if direct_runs else None
    return replace(cost(runs), source=source, direct_ingress=direct)


def describe(plan: dict[str, Any], streamed: bool = True, direct_ingress: bool = False) -> str:
    cores = plan["cores"]
    front = "HAProxy" if direct_ingress else "HTTP proxies"
    return (f"serving layer ({'streamed' if streamed else 'not streamed'}"
            f"{', direct ingress' if direct_ingress else ''}, measured {plan['us_per_token']:.0f} us of "
            f"CPU per output token): {plan['total_cores']:.1f} cores = {plan['cores_per_device']:.2f} per device "
            f"(ingress {cores.get('ingress', 0):.1f} in {plan['ingress_replicas']} replicas, {front} "
            f"{cores.get('proxy', 0):.1f}, workers' host side {cores.get('worker', 0):.1f})")
