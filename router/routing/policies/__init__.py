"""Routing policies by name: kvserve's KV-headroom router and the baselines it is measured
against, as pure rankings (no Ray). router/routing/serve_router.py runs any of them as a Ray Serve
request router; the discrete-event simulator (cluster/sim/) runs the same objects on its
virtual clock. See router/routing/policies/base.py for the protocol.

    round_robin      rotate through the replicas
    pow2             Ray Serve's default: two random replicas, the shorter queue
    least_kv         AIBrix / production-stack: least KV usage at the last report
    prefix_affinity  SGLang's cache-aware router: longest prefix match in the router's own
                     record unless the load is imbalanced, then the shortest queue
    sticky           llm-d: stay on the cache-warm replica until its uncached-token backlog
                     exceeds prefill throughput x target time, then the least-loaded
    headroom         kvserve: KV headroom with reservations, work-based load (uncached prefill
                     tokens), prefix and session affinity released at a target TTFT
                     (router/routing/scoring.py)

Baselines for the simulator and benchmarks only (make_policy builds them; Serve's config
accepts only POLICY_NAMES):

    lora_affinity    the Gateway API Inference Extension's LoRA-aware scheduler (needs the
                     replicas' max_loras)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from router.routing.types import RoutingParams
from router.routing.policies.base import RoutingPolicy, RoutingRequest, check_options
from router.routing.policies.headroom import HeadroomPolicy
from router.routing.policies.lora_affinity import LoraAffinityOptions, LoraAffinityPolicy
from router.routing.policies.prefix_affinity import PrefixAffinityOptions, PrefixAffinityPolicy
from router.routing.policies.simple import LeastKVPolicy, PowerOfTwoPolicy, RoundRobinPolicy
from router.routing.policies.sticky import StickyOptions, StickyPolicy
from router.routing.routing_view import RoutingView

__all__ = ["POLICY_NAMES", "SIM_POLICY_NAMES", "RoutingPolicy", "RoutingRequest", "make_policy",
           "split_policy_kwargs"]


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _round_robin(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("round_robin", options, ())
    return RoundRobinPolicy()


def _pow2(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("pow2", options, ())
    return PowerOfTwoPolicy(seed)


def _least_kv(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("least_kv", options, ())
    return LeastKVPolicy()


def _prefix_affinity(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("prefix_affinity", options, _names(PrefixAffinityOptions))
    return PrefixAffinityPolicy(PrefixAffinityOptions(**options))


def _sticky(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("sticky", options, _names(StickyOptions))
    return StickyPolicy(StickyOptions(**options), params)


def _headroom(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("headroom", options, ())
    return HeadroomPolicy(params, seed, view=view)


# Only headroom takes a routing view (router/routing/routing_view.py); the baselines keep their own
# state, as the routers they reproduce do (each router replica sees its own dispatches).
_FACTORIES: dict[str, Callable[[RoutingParams, int, dict[str, Any], RoutingView | None], RoutingPolicy]] = {
    "round_robin": _round_robin,
    "pow2": _pow2,
    "least_kv": _least_kv,
    "prefix_affinity": _prefix_affinity,
    "sticky": _sticky,
    "headroom": _headroom,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def _lora_affinity(params: RoutingParams, seed: int, options: dict[str, Any], view: RoutingView | None) -> RoutingPolicy:
    check_options("lora_affinity", options, _names(LoraAffinityOptions))
    if "max_loras" not in options:
        raise ValueError("routing policy 'lora_affinity' needs the option max_loras (the replicas' lora.max_loras)")
    return LoraAffinityPolicy(LoraAffinityOptions(**options), seed)


_SIM_FACTORIES = {**_FACTORIES, "lora_affinity": _lora_affinity}
# Every policy the simulator and benchmarks can run: the served ones and the baselines above.
SIM_POLICY_NAMES: tuple[str, ...] = tuple(_SIM_FACTORIES)


def make_policy(
    name: str, params: RoutingParams | None = None, seed: int = 0, view: RoutingView | None = None, **options: Any
) -> RoutingPolicy:
    """A fresh policy instance (one per router: policies keep per-router state).

    `params` carries the settings every router shares with the headroom policy (stats
    period, report lag, ...); `options` are the policy's own (PrefixAffinityOptions,
    StickyOptions); an option the policy does not know is an error."""
    factory = _SIM_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {list(SIM_POLICY_NAMES)}")
    return factory(params or RoutingParams(), seed, dict(options), view)


def split_policy_kwargs(kwargs: Mapping[str, Any]) -> tuple[str, RoutingParams, dict[str, Any]]:
    """request_router_kwargs -> (policy name, RoutingParams, the policy's own options):
    {"policy": "sticky", "stats_period_s": 1.0, "target_s": 10.0} splits into
    ("sticky", RoutingParams(stats_period_s=1.0), {"target_s": 10.0})."""
    rest = dict(kwargs)
    name = rest.pop("policy", "headroom")
    shared = {k: rest.pop(k) for k in list(rest) if k in _names(RoutingParams)}
    return str(name), RoutingParams(**shared), rest
