"""Routing views (router/routing_view.py): the hint table, and why a shared view exists:
routers with private views herd onto the replica that looked best at the last report."""
from __future__ import annotations

from collections import Counter

from kv.block_hash import hash_full_blocks
from router.headroom import HeadroomParams, ReplicaReport, ReplicaView
from router.policies.base import RoutingRequest
from router.policies.headroom import HeadroomPolicy
from router.routing_view import HintTable, LocalRoutingView, RoutingView

BS = 16
NOW = 1000.0
PREFIX = list(range(1, 49))  # three full blocks every request of the burst shares


def report(free_blocks: int, prefix_hashes: list[int]) -> ReplicaReport:
    parsed = ReplicaReport.from_stats({
        "free_blocks": free_blocks, "total_blocks": 1000, "block_size": BS, "num_running": 0,
        "num_waiting": 0, "num_waiting_prompt_tokens": 0, "reserved_blocks": 0,
        "prefix_hashes": prefix_hashes, "timestamp": NOW - 0.5, "healthy": True,
    })
    assert parsed is not None
    return parsed


def test_local_view_is_a_routing_view() -> None:
    assert isinstance(LocalRoutingView(), RoutingView)


def test_hints_match_leading_blocks_per_replica() -> None:
    table = HintTable(ttl_s=60)
    chain = hash_full_blocks(list(range(64)), BS)  # 4 blocks
    table.learn("a", chain, NOW)
    table.learn("b", chain[:2], NOW)
    assert table.match(chain) == {"a": 4, "b": 2}
    assert table.match(chain[:1]) == {"a": 1, "b": 1}
    other = hash_full_blocks(list(range(100, 164)), BS)
    assert table.match(other) == {}


def test_hints_expire_and_are_bounded() -> None:
    table = HintTable(ttl_s=10, max_hashes=3)
    old = hash_full_blocks(list(range(32)), BS)  # 2 blocks
    table.learn("a", old, NOW)
    new = hash_full_blocks(list(range(500, 532)), BS)
    table.learn("b", new, NOW + 11)  # a's hints are now older than the ttl; LRU keeps 3 hashes
    assert len(table) == 3
    assert table.match(old) == {}
    assert table.match(new) == {"b": 2}


def test_forget_drops_a_gone_replica() -> None:
    view = LocalRoutingView()
    chain = hash_full_blocks(list(range(32)), BS)
    view.reserve("x", "a", {"a": 1}, NOW)
    view.learn_prefix("a", chain, NOW)
    view.learn_prefix("b", chain, NOW)
    view.prune(NOW, {"b"}, unconfirmed_ttl_s=60, ttl_s=3600)
    assert view.prefix_owner_hints(chain) == {"b": 2}


def _burst(policies: list[HeadroomPolicy], views: list[ReplicaView], n: int) -> list[str]:
    """n requests sharing PREFIX, sent round robin through the routers (one ingress each),
    all within one stats period: each goes to its router's first rank."""
    chosen = []
    for i in range(n):
        policy = policies[i % len(policies)]
        request = RoutingRequest(f"q{i}", PREFIX + [1000 + i] * 16, max_tokens=8)
        top = policy.rank(request, views, NOW)[0]
        policy.on_dispatch(request, top, NOW)
        chosen.append(top)
    return chosen


def test_private_views_herd_onto_the_prefix_owner_and_a_shared_view_does_not() -> None:
    """Replica a caches the burst's prefix but has room for few requests; b is empty.
    One router stops sending to a once its own reservations fill a. Two routers with
    private views each fill a on their own: a gets about twice what fits. Two routers
    sharing one view route the burst exactly as one router would."""
    params = HeadroomParams(stats_period_s=1.0, expected_output_tokens=8)
    views = [ReplicaView("a", report(12, hash_full_blocks(PREFIX, BS))), ReplicaView("b", report(400, []))]
    n = 24

    single = _burst([HeadroomPolicy(params)], views, n)
    privates = [HeadroomPolicy(params, seed=1), HeadroomPolicy(params, seed=2)]
    private = _burst(privates, views, n)
    shared_view = LocalRoutingView(params.report_lag_s)
    shared = _burst([HeadroomPolicy(params, seed=1, view=shared_view), HeadroomPolicy(params, seed=2, view=shared_view)], views, n)

    on_a = {name: Counter(c)["a"] for name, c in (("single", single), ("private", private), ("shared", shared))}
    assert shared == single
    assert on_a["private"] >= 2 * on_a["single"] > 0, on_a
    # a has 12 free blocks: the shared view never promises more; the private ones together do.
    assert shared_view.unreflected("a").requests == on_a["shared"]
    assert shared_view.unreflected("a").blocks <= 12
    assert sum(p.ledger.unreflected("a").blocks for p in privates) > 12
