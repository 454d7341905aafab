"""What every routing policy sees and promises (pure Python: no Ray, no torch).

A policy ranks the candidate replicas for one request, best first; the caller (Serve's
request router in router/routing/serve_router.py, or the discrete-event simulator in cluster/sim/)
tries them in that order and tells the policy what happened through the hooks:

    rank(request, views, now)            -> [replica keys], best first
    on_dispatch(request, replica, now)   the request was sent to `replica` (maybe not the first rank)
    on_complete(request_id, replica, now) it finished, failed or was cancelled there
    on_report(replica, report, now)      a new routing-stats report from `replica` arrived

`views` are router/routing/types.py's ReplicaView: the replica's last report (seconds old, or
None before the first one) and `queue_len`, the requests outstanding there as the caller
knows them (Serve's queue-length cache, else this router's own count; the simulator gives
the replica's true ongoing count, which is what Serve's probes measure). Policies that keep
a reservation ledger fill `unreflected_*` themselves: whatever the caller put there is
ignored. A replica whose last report says it is unhealthy is never ranked.

`now` is the caller's clock (time.time() under Serve, the virtual clock in the simulator);
reports carry timestamps on the same clock.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kv.block_hash import ROOT_HASH
from router.routing.types import ReplicaKey, ReplicaReport, ReplicaView, RequestProfile


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    session_id: str | None = None
    hash_root: int = ROOT_HASH  # its block-hash chain's root (RequestProfile.hash_root)
    lora_name: str | None = None  # its LoRA adapter (RequestProfile.lora_name)
    # Block hashes memoised per block size, shared by every rank() of this request (a retry
    # after a rejection ranks again without rehashing).
    profile: RequestProfile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", RequestProfile(self.prompt_token_ids, self.max_tokens, self.hash_root,
                                                              self.lora_name))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@runtime_checkable
class RoutingPolicy(Protocol):
    name: str

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]: ...

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None: ...

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None: ...

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None: ...


class StatelessHooks:
    """Hooks for policies that keep no per-request state."""

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        return None

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        return None

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        return None


def healthy(views: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The views a policy may rank: not reported unhealthy (however old that report)."""
    return [v for v in views if v.report is None or v.report.healthy]


def sorted_keys(views: Sequence[ReplicaView], key: Callable[[ReplicaView], Any]) -> list[ReplicaKey]:
    """Keys ordered by `key`, ties in candidate order (stable sort): deterministic."""
    index = {id(v): i for i, v in enumerate(views)}
    return [v.key for v in sorted(views, key=lambda v: (key(v), index[id(v)]))]


def kv_usage(report: ReplicaReport | None) -> float:
    """Fraction of the replica's KV blocks in use at its last report; 0 before the first."""
    if report is None or report.total_blocks <= 0:
        return 0.0
    return 1.0 - report.free_blocks / report.total_blocks


def check_options(policy: str, options: dict[str, Any], known: Sequence[str]) -> None:
    """Unknown options are an error: a typo must not silently run the defaults."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for routing policy {policy!r}; known: {sorted(known)}")
