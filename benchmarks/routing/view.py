"""What a routing view costs per decision and what it buys: private vs shared through Redis,
read once per decision (one round trip) or from a cache refreshed in the background.

Two routers (HeadroomPolicy objects, as two ingress replicas run them) on one event loop,
one real redis-server on loopback (started here), 8 replicas with reports that stay fresh
and never reflect the burst (the worst case a stats period allows). Per variant:

  * decision latency: `await view.sync(candidates)` (the Serve router awaits it before
    ranking) + `policy.rank` + `on_dispatch`, per decision, over requests alternating
    between the two routers at a fixed gap (p50 / p99 in microseconds), and Redis round
    trips per decision;
  * over-commit: replica 0 caches the burst's prefix and has OWNER_FREE_BLOCKS free; the
    blocks both routers together promise it during the burst, over what it has (1.0 =
    exactly full; a private view lets each router fill it: ~2.0).

    python -m benchmarks.routing.view [--requests 400] [--gaps-ms 0.2,1,5,20]

Prints per (variant, gap) one line, then `RESULT ...` with the p50 decision latencies and
over-commit at the smallest gap.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kv.block_hash import hash_full_blocks
from router.routing.types import RoutingParams, ReplicaReport, ReplicaView
from router.routing.policies.base import RoutingRequest
from router.routing.policies.headroom import HeadroomPolicy
from router.routing.redis_view import RedisRoutingView, SharedViewSpec
from router.routing.routing_view import LocalRoutingView, RoutingView

BS = 16
NUM_REPLICAS = 8
OWNER_FREE_BLOCKS = 64
PREFIX = list(range(1, 49))  # 3 full blocks every request shares
VARIANTS = ("private", "per_decision", "cached")


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            client = redis.Redis(port=port, socket_timeout=1)
            deadline = time.monotonic() + 10
            while True:  # bounded wait for the server to answer
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def reports(now: float) -> list[ReplicaView]:
    views = []
    for i in range(NUM_REPLICAS):
        owner = i == 0
        report = ReplicaReport.from_stats({
            "free_blocks": OWNER_FREE_BLOCKS if owner else 2000, "total_blocks": 4000, "block_size": BS,
            "num_running": 0, "num_waiting": 0, "num_waiting_prompt_tokens": 0, "reserved_blocks": 0,
            "prefix_hashes": hash_full_blocks(PREFIX, BS) if owner else [], "timestamp": now, "healthy": True,
        })
        views.append(ReplicaView(f"replica-{i}", report))
    return views


def make_view(variant: str, url: str, prefix: str) -> RoutingView:
    if variant == "private":
        return LocalRoutingView()
    # decision_wait_s 50 ms: long enough that a loaded box's slow read is waited for (the
    # figure is then the real round trip, not the bound).
    spec = SharedViewSpec(url=url, key_prefix=prefix, mode=variant, socket_timeout_s=1.0, decision_wait_s=0.05,
                          refresh_s=0.05)
    return RedisRoutingView(spec)


async def run(variant: str, url: str, num_requests: int, gap_s: float) -> dict[str, float]:
    prefix = f"kvserve-bench:{uuid.uuid4().hex[:8]}"
    params = RoutingParams(stats_period_s=3600.0, expected_output_tokens=64)  # reports stay fresh
    routers = [make_view(variant, url, prefix) for _ in range(2)]
    policies = [HeadroomPolicy(params, seed=i, view=v) for i, v in enumerate(routers)]
    now = time.time()
    views = reports(now - 0.5)
    keys = [v.key for v in views]
    for policy in policies:
        for v in views:
            assert v.report is not None
            policy.on_report(v.key, v.report, now)
    for view in routers:  # connect + first read before timing (a router's start-up)
        if isinstance(view, RedisRoutingView):
            await view.sync(keys)
            await asyncio.sleep(0.1)
    latencies: list[float] = []
    promised_to_owner = 0
    trips_before = sum(getattr(v, "num_round_trips", 0) for v in routers)
    for i in range(num_requests):
        policy, view = policies[i % 2], routers[i % 2]
        # The burst shares PREFIX; each needs 8 blocks beyond it (its own 64 tokens + 64 decode).
        request = RoutingRequest(f"q{i}", PREFIX + [10_000 + i] * 64, max_tokens=64)
        started = time.perf_counter()
        if isinstance(view, RedisRoutingView):
            await view.sync(keys)
        order = policy.rank(request, views, time.time())
        policy.on_dispatch(request, order[0], time.time())
        latencies.append(time.perf_counter() - started)
        if order[0] == "replica-0":
            promised_to_owner += request.profile.total_blocks(BS, 64) - 3  # its need beyond the cached prefix
        await asyncio.sleep(gap_s)  # the arrival gap (lets background reads and writes run)
    trips = sum(getattr(v, "num_round_trips", 0) for v in routers) - trips_before
    for view in routers:
        if isinstance(view, RedisRoutingView):
            await view.aclose()
    latencies.sort()
    return {
        "p50_us": statistics.median(latencies) * 1e6,
        "p99_us": latencies[int(0.99 * (len(latencies) - 1))] * 1e6,
        "mean_us": statistics.fmean(latencies) * 1e6,
        "round_trips_per_decision": trips / num_requests,
        "overcommit": promised_to_owner / OWNER_FREE_BLOCKS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--gaps-ms", default="0.2,1,5,20", help="arrival gaps between decisions (ms)")
    args = parser.parse_args()
    gaps = [float(g) / 1000 for g in args.gaps_ms.split(",")]
    print(f"routing view benchmark: {NUM_REPLICAS} replicas, 2 routers, {args.requests} decisions per run, "
          f"owner free blocks {OWNER_FREE_BLOCKS}, load average {os.getloadavg()[0]:.1f}")
    results: dict[tuple[str, float], dict[str, float]] = {}
    with redis_server() as url:
        for gap in gaps:
            for variant in VARIANTS:
                r = asyncio.run(run(variant, url, args.requests, gap))
                results[(variant, gap)] = r
                print(f"{variant:13s} gap {gap * 1000:5.1f} ms: decision p50 {r['p50_us']:7.0f} us  p99 {r['p99_us']:7.0f} us"
                      f"  mean {r['mean_us']:7.0f} us  round trips/decision {r['round_trips_per_decision']:.2f}"
                      f"  owner over-commit {r['overcommit']:.2f}x", flush=True)
    g = gaps[0]
    print("RESULT " + " ".join(
        [f"{v}_p50_us={results[(v, g)]['p50_us']:.0f}" for v in VARIANTS]
        + [f"{v}_overcommit={results[(v, g)]['overcommit']:.2f}" for v in VARIANTS]
        + [f"gap_ms={g * 1000:g}"]))


if __name__ == "__main__":
    main()
