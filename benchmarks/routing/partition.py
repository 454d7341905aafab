"""The ideal partition: the table's yardstick for the cache-aware workloads (b2b, agentic).

The cluster's own workload (the very requests a router's run at that rate gets), its
sessions or prefix groups dealt to the N replicas in order of first arrival (the k-th to
appear goes to replica k mod N), each replica simulated alone on its share, the figures
taken over every share's requests and tokens together. Perfect affinity (a session's turns,
a group's questions, always meet their cache) and even shares, with no routing at all.
Not an upper bound: a router may also even out bursts between replicas, and a dealt share
can be unlucky (long sessions piling up on one replica), as a real static partition can.

The shares are dealt over the whole cluster's workload, not taken as one replica's sample
at 1/N of the rate times N: a single replica's sample holds a dozen sessions or so, and
which dozen decides its goodput (seeds of the same rate meet and miss the SLO).
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace

from benchmarks.routing.search import RunFigures, collector_paused, goodput_at_slo
from benchmarks.routing.setup import HEADROOM, Plan, sim_config
from cluster.sim.metrics import SimResult
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest, make_workload

Log = Callable[[str], None]


def deal_shares(requests: Sequence[SimRequest], num_shares: int) -> list[list[SimRequest]]:
    """Each session (or prefix group: SimRequest.session_id) to one share, dealt round
    robin in order of its first request's arrival; a request without a session is dealt
    on its own. Every share keeps arrival order."""
    owner: dict[str, int] = {}
    shares: list[list[SimRequest]] = [[] for _ in range(num_shares)]
    dealt = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        key = request.session_id
        if key is None or key not in owner:
            share = dealt % num_shares
            dealt += 1
            if key is not None:
                owner[key] = share
        else:
            share = owner[key]
        shares[share].append(request)
    return shares


def merge_results(results: Sequence[SimResult]) -> SimResult:
    """One result of several simulations run side by side (the partition's replicas): their
    records, replicas and inter-token gaps together, so that percentiles, goodput and load
    imbalance are the whole partition's."""
    itl = array("f")
    for result in results:
        itl.extend(result.itl)
    return SimResult(
        config=results[0].config,
        records=[record for result in results for record in result.records],
        replicas=[replica for result in results for replica in result.replicas],
        itl=itl,
        num_events=sum(result.num_events for result in results),
        router_stats=[stats for result in results for stats in result.router_stats],
    )


def run_partition(workload: str, num_replicas: int, seed: int, rate: float, plan: Plan, workload_kw: dict,
                  device: SimDevice, log: Log | None = None, config: SimConfig | None = None) -> RunFigures:
    """The partition at `rate` (the cluster's): one simulation per share, merged. `config`:
    one replica's (default: the table's; nothing to route)."""
    t0 = time.perf_counter()
    requests = make_workload(workload, plan.window_for(workload).num_requests(rate), rate, seed, **workload_kw)
    config = replace(config or sim_config(HEADROOM, 1), seed=seed)
    with collector_paused():
        results = [simulate(config, share, device) for share in deal_shares(requests, num_replicas) if share]
    fig = RunFigures.from_summary(rate, merge_results(results).summary(), config.slo_ttft_ms / 1000.0,
                                  config.slo_itl_ms / 1000.0)
    if log is not None:
        log(f"    {workload} x{num_replicas} ideal partition seed {seed} rate {rate:8.2f} ({len(requests)} req): "
            f"{'meets' if fig.meets_slo else 'misses'} SLO, TTFT p99 {fig.ttft_p99_s:7.3f} s, "
            f"ITL p99 {1000 * fig.itl_p99_s:6.1f} ms, hit {fig.hit_rate:.3f}, imbalance {fig.imbalance:.2f} "
            f"({time.perf_counter() - t0:.1f} s)")
    return fig


def partition_goodput(workload: str, num_replicas: int, seed: int, plan: Plan, workload_kw: dict,
                      start: float, known_miss: float | None, log: Log | None = None) -> tuple[float, float]:
    """The partition's goodput at the SLO and its CPU seconds, searched on the table's grid
    of rates from `start` with `known_miss` as its first step up (the benchmark passes
    headroom's goodput and first miss: two runs when they tie)."""
    cpu0 = time.process_time()
    device = SimDevice.from_config(sim_config(HEADROOM, 1))
    fig = goodput_at_slo(lambda rate: run_partition(workload, num_replicas, seed, rate, plan, workload_kw, device, log),
                         start, plan.search, known_miss)
    return (fig.rate_rps if fig.meets_slo else 0.0), time.process_time() - cpu0
