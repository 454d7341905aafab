"""What the serving layer around the devices costs: the CPU the front door (HAProxy, or
Serve's HTTP proxies), ingress replicas and worker replicas' host side spend per output
token, and the ingress replicas and cores a simulated cluster's token rate therefore needs
(`kvserve simulate` prints it).

The figures are measured, not modelled: `python -m benchmarks.hostpath --write-serving-cost`
runs the whole Serve path at device speed (time dilation 1) on simulated devices and writes
the CPU seconds per output token of each kind of process, streamed (SSE) and not, into
cluster/sim/serving_cost.json. They are a property of the serving code and the CPU it ran
on, not of the device: the same per-token cost applies to any device's token rate.

    cores(kind)        = output tokens/s x cpu_s_per_token(kind, streamed)
    ingress replicas   = ceil(cores(ingress) / INGRESS_REPLICA_CORES)

Two sets of figures: through Serve's direct ingress (kvserve's default: HAProxy in front of
the ingress replicas, whose CPU the "proxy" kind counts), at the top level of the file, and
through Serve's HTTP proxies (`kvserve serve --serve-proxy`), under "serve_proxy", written
when the benchmark ran that path too (`--serve-proxy`); `kvserve simulate` plans with the
first, `kvserve simulate --serve-proxy` with the second.

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
    """CPU seconds per output token, per kind of process, streamed and not, through the
    default front door (direct ingress)."""

    streamed: dict[str, float]
    plain: dict[str, float]
    source: str = ""
    serve_proxy: ServingCost | None = None  # the same figures through Serve's HTTP proxies

    @classmethod
    def load(cls, path: Path = DEFAULT_PATH) -> ServingCost:
        data = json.loads(path.read_text())
        proxy = data.get("serve_proxy")
        return cls(dict(data["streamed"]), dict(data["plain"]), str(data.get("source", "")),
                   cls(dict(proxy["streamed"]), dict(proxy["plain"])) if proxy is not None else None)

    def to_json(self) -> str:
        data: dict[str, Any] = {"streamed": self.streamed, "plain": self.plain, "source": self.source}
        if self.serve_proxy is not None:
            data["serve_proxy"] = {"streamed": self.serve_proxy.streamed, "plain": self.serve_proxy.plain}
        return json.dumps(data, indent=2) + "\n"

    def path(self, serve_proxy: bool) -> ServingCost:
        """The figures of one front door: direct ingress (the default), or Serve's proxies."""
        if not serve_proxy:
            return self
        if self.serve_proxy is None:
            raise ValueError("no figures measured through Serve's proxies: run `python -m benchmarks.hostpath "
                             "--serve-proxy --write-serving-cost`")
        return self.serve_proxy

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


def from_runs(runs: list[Any], source: str, proxy_runs: list[Any] | None = None) -> ServingCost:
    """From benchmarks/hostpath_serve.py's runs through the default front door: each kind's
    CPU over all tokens (a ratio of sums), streamed and not; `proxy_runs`: those through
    Serve's HTTP proxies, if that path ran."""

    def ratio(selected: list[Any]) -> dict[str, float]:
        tokens = max(sum(r.tokens for r in selected), 1)
        return {kind: sum(r.cpu_s.get(kind, 0.0) for r in selected) / tokens for kind in KINDS}

    def cost(selected: list[Any]) -> ServingCost:
        return ServingCost(ratio([r for r in selected if r.stream]), ratio([r for r in selected if not r.stream]))

    proxy = cost(proxy_runs) if proxy_runs else None
    return replace(cost(runs), source=source, serve_proxy=proxy)


def describe(plan: dict[str, Any], streamed: bool = True, serve_proxy: bool = False) -> str:
    """One report line for `plan`, naming its front door: `serve_proxy` when the plan was
    made with Serve's proxies' figures (`ServingCost.path(serve_proxy=True)`)."""
    cores = plan["cores"]
    front = "Serve's HTTP proxies" if serve_proxy else "HAProxy (direct ingress)"
    return (f"serving layer ({'streamed' if streamed else 'not streamed'}, measured {plan['us_per_token']:.0f} us of "
            f"CPU per output token): {plan['total_cores']:.1f} cores = {plan['cores_per_device']:.2f} per device "
            f"(ingress {cores.get('ingress', 0):.1f} in {plan['ingress_replicas']} replicas, {front} "
            f"{cores.get('proxy', 0):.1f}, workers' host side {cores.get('worker', 0):.1f})")
