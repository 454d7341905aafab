"""Routing views (router/routing/routing_view.py): the hint table, and why a shared view exists:
routers with private views herd onto the replica that looked best at the last report."""
from __future__ import annotations

from collections import Counter

from kv.block_hash import hash_full_blocks
from router.routing.types import RoutingParams, ReplicaReport, ReplicaView
from router.routing.policies.base import RoutingRequest
from router.routing.policies.headroom import HeadroomPolicy
from router.routing.routing_view import HintTable, LocalRoutingView, RoutingView

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


def test_hints_expire() -> None:
    table = HintTable(ttl_s=10)
    old = hash_full_blocks(list(range(32)), BS)  # 2 blocks
    table.learn("a", old, NOW)
    new = hash_full_blocks(list(range(500, 532)), BS)
    table.learn("b", new, NOW + 11)  # a's hints are now older than the ttl
    assert table.match(old) == {}
    assert table.match(new) == {"b": 2}


def test_hints_are_bounded_per_replica_least_recently_learned_first() -> None:
    """Replica b's stream of new prompts does not push out what a was sent: each replica
    keeps its own max_hashes (a busy cluster's newest prompts would otherwise erase where
    every older conversation lives while the replicas still cache it)."""
    table = HintTable(ttl_s=60, max_hashes=4)
    history = hash_full_blocks(list(range(64)), BS)  # 4 blocks
    table.learn("a", history, NOW)
    for i in range(5):
        table.learn("b", hash_full_blocks(list(range(1000 * (i + 1), 1000 * (i + 1) + 32)), BS), NOW + i)
    assert table.match(history) == {"a": 4}
    assert len(table) == 4 + 4  # b keeps its 4 newest hashes: its last two prompts
    assert table.match(hash_full_blocks(list(range(5000, 5032)), BS)) == {"b": 2}
    assert table.match(hash_full_blocks(list(range(3000, 3032)), BS)) == {}
    # Beyond a's bound its least recently learned hashes go, leaves before their root.
    table.learn("a", hash_full_blocks(list(range(200, 232)), BS), NOW + 9)
    assert table.match(history) == {"a": 2}
    table.forget(["a", "b"])
    assert len(table) == 0 and table.match(history) == {}


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
    params = RoutingParams(stats_period_s=1.0, expected_output_tokens=8)
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


# ---------------------------------------------------------------- the view shared through Redis
# Two RedisRoutingView objects on one real redis-server play two ingress replicas' routers.
import asyncio  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from router.routing.redis_view import RedisRoutingView, SharedViewSpec  # noqa: E402
from router.routing.reservations import Unreflected  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402


def redis_views(server: RedisServer, n: int = 2, **fields: Any) -> list[RedisRoutingView]:
    # socket timeout 1 s: a loaded CI machine must not look like an outage here; a decision
    # waits up to 1 s for its read, so that every read lands before the test looks.
    spec = SharedViewSpec(url=server.url, key_prefix=f"kvserve-test:{uuid.uuid4().hex[:8]}",
                          **{"socket_timeout_s": 1.0, "decision_wait_s": 1.0, **fields})
    return [RedisRoutingView(spec, report_lag_s=0.05) for _ in range(n)]


async def eventually(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    """Polls `condition` on the running loop (the views' background tasks run meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def close(*views: RedisRoutingView) -> None:
    for v in views:
        await v.aclose()


def test_redis_view_is_a_routing_view(redis_server: RedisServer) -> None:
    assert isinstance(redis_views(redis_server, 1)[0], RoutingView)


def test_each_router_sees_the_others_work_once(redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = redis_views(redis_server)
        await a.sync(["r1", "r2"])
        a.reserve("x", "r1", {"r1": 3, "r2": 5}, time.time(), prefill_tokens={"r1": 40, "r2": 80}, decode_blocks=2)
        b.reserve("y", "r1", {"r1": 1}, time.time(), prefill_tokens=10)

        async def b_sees_a() -> bool:
            await b.sync(["r1", "r2"])
            return b.unreflected("r1") == Unreflected(4, 2, 50, 2)

        await eventually(b_sees_a, "b to read a's reservation")
        a.routed("x", "r2")  # Serve sent it to a lower rank: the reservation moves there

        async def b_sees_the_move() -> bool:
            await b.sync(["r1", "r2"])
            return b.unreflected("r1") == Unreflected(1, 1, 10, 0) and b.unreflected("r2") == Unreflected(5, 1, 80, 2)

        await eventually(b_sees_the_move, "the move")
        await a.sync(["r1", "r2"])
        assert a.unreflected("r1") == Unreflected(1, 1, 10, 0)  # own work counted once
        a.complete("x", "r2")

        async def gone() -> bool:
            await b.sync(["r1", "r2"])
            return b.unreflected("r2") == Unreflected()

        await eventually(gone, "the completion")
        assert a.num_round_trips > 0
        await close(a, b)

    asyncio.run(main())


def test_a_report_that_reflects_the_others_dispatch_stops_counting_it(redis_server: RedisServer) -> None:
    """Router a is idle after its dispatch and never sees the replica's next report; b
    does: b stops counting a's work at once, without waiting for a."""
    async def main() -> None:
        a, b = redis_views(redis_server)
        t = time.time()
        a.reserve("x", "r1", {"r1": 7}, t)
        await a.sync(["r1"])

        async def b_sees_a() -> bool:
            await b.sync(["r1"])
            return b.unreflected("r1").blocks == 7

        await eventually(b_sees_a, "b to read a's reservation")
        b.observe_report("r1", t + 1.0)
        assert b.unreflected("r1") == Unreflected()
        await close(a, b)

    asyncio.run(main())


def test_hints_are_shared_and_a_new_router_starts_with_them(redis_server: RedisServer) -> None:
    chain = hash_full_blocks(list(range(64)), BS)

    async def main() -> None:
        a, b = redis_views(redis_server)
        await a.sync(["r1"])
        a.learn_prefix("r1", chain, time.time())

        async def b_learns() -> bool:
            await b.sync(["r1", "r2"])
            return b.prefix_owner_hints(chain) == {"r1": 4}

        await eventually(b_learns, "b to learn a's hint")
        late = RedisRoutingView(a.spec)  # started after the hint was learned (warm start)
        await late.sync(["r1", "r2"])
        assert late.prefix_owner_hints(chain[:2]) == {"r1": 2}
        assert late.prefix_owner_hints(hash_full_blocks(list(range(500, 564)), BS)) == {}
        await close(a, b, late)

    asyncio.run(main())


def test_cached_mode_reads_in_the_background(redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = redis_views(redis_server, mode="cached", refresh_s=0.01)
        await a.sync(["r1"])
        await b.sync(["r1"])
        a.reserve("x", "r1", {"r1": 2}, time.time())
        trips = b.num_round_trips

        async def b_sees_a() -> bool:
            await b.sync(["r1"])  # never waits on Redis in this mode
            return b.unreflected("r1").blocks == 2

        await eventually(b_sees_a, "the background read")
        assert b.num_round_trips > trips
        await close(a, b)

    asyncio.run(main())


def test_redis_down_falls_back_to_the_private_view_and_back(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        a, b = redis_views(redis_server, socket_timeout_s=0.2)
        await b.sync(["r1"])  # binds b to this loop: its writes go out from here
        b.reserve("y", "r1", {"r1": 1}, time.time())
        a.reserve("x", "r1", {"r1": 3}, time.time())

        async def both() -> bool:
            await a.sync(["r1"])
            return a.unreflected("r1").blocks == 4

        await eventually(both, "a to read b's reservation")
        redis_server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="router.routing.redis_view"):
                a.reserve("z", "r1", {"r1": 5}, time.time())  # the write finds Redis down
                await eventually(lambda: _true_after(a.sync(["r1"]), lambda: not a.up), "a to notice the outage")
                started = time.monotonic()
                await a.sync(["r1"])
                assert time.monotonic() - started < 0.1  # down: nothing waits on Redis
                assert a.unreflected("r1") == Unreflected(8, 2)  # exactly the private view
        finally:
            redis_server.start()
        await eventually(lambda: _true_after(asyncio.sleep(0), lambda: a.up), "a to reconnect")
        b.reserve("y2", "r1", {"r1": 10}, time.time())  # b's client reconnects on its own

        async def shared_again() -> bool:
            await a.sync(["r1"])
            await b.sync(["r1"])
            return a.unreflected("r1").blocks == 19 and b.unreflected("r1").blocks == 19

        await eventually(shared_again, "both views shared again (Redis restarted empty: republished)")
        # One line each way per transition: a saw one outage; b may have seen none, one, or
        # (its pooled connection reset once more after the restart) a second short one, but
        # its lines still alternate down/back and end with back.
        for view, times in ((a, {1}), (b, {0, 1, 2})):
            lines = [r.getMessage() for r in caplog.records if r.name == "router.routing.redis_view" and view.router_id in r.getMessage()]
            kinds = ["down" if "unreachable" in m else "back" for m in lines if "unreachable" in m or "is back;" in m]
            assert kinds == ["down", "back"] * (len(kinds) // 2) and len(kinds) // 2 in times, lines
        await close(a, b)

    asyncio.run(main())


async def _true_after(step: Awaitable[Any], condition: Callable[[], bool]) -> bool:
    await step
    return condition()


# ---------------------------------------------------------------- the config wires it
def test_the_config_shares_the_view_when_redis_is_set_and_never_splits_the_headroom() -> None:
    from cluster.app import request_router_config
    from cluster.config import KVServeConfig

    private = request_router_config(KVServeConfig.from_dict({"ingress": {"num_replicas": 4}}))
    assert private is not None
    kwargs = private.request_router_kwargs
    assert "shared_view" not in kwargs and kwargs["warm_start"] is True
    assert kwargs["headroom_share"] == 1.0  # no static 1/N patch: 4 ingress replicas, whole headroom

    shared = request_router_config(KVServeConfig.from_dict({
        "app_name": "a", "ingress": {"num_replicas": 2}, "state": {"redis_url": "redis://r:6379/0"},
        "routing": {"shared_view_mode": "cached", "shared_view_refresh_s": 0.1, "warm_start": False}}))
    assert shared is not None
    spec = SharedViewSpec.from_dict(shared.request_router_kwargs["shared_view"])
    assert (spec.url, spec.key_prefix, spec.mode, spec.refresh_s) == ("redis://r:6379/0", "kvserve:a", "cached", 0.1)
    assert shared.request_router_kwargs["warm_start"] is False

    baseline = request_router_config(KVServeConfig.from_dict({
        "routing": {"router": "sticky", "shared_view": False}, "state": {"redis_url": "redis://r:6379/0"}}))
    assert baseline is not None and "shared_view" not in baseline.request_router_kwargs


def test_the_view_benchmark_measures_what_it_claims(redis_server: RedisServer) -> None:
    """benchmarks/routing/view.py on a short burst: the per-decision shared view never
    over-commits the prefix owner, private views fill it once per router."""
    from benchmarks.routing.view import run

    per_decision = asyncio.run(run("per_decision", redis_server.url, 24, 0.0))
    private = asyncio.run(run("private", redis_server.url, 24, 0.0))
    assert per_decision["overcommit"] == 1.0 and private["overcommit"] == 2.0
    assert per_decision["round_trips_per_decision"] >= 1.0 and private["round_trips_per_decision"] == 0.0
