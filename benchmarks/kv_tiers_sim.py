"""KV tiers in the simulator: simulated H200s (llama-3-8b) whose working set is past the
device KV, with and without tiers below the device (cluster/sim/tiers.py).

    python -m benchmarks.kv_tiers_sim [--quick]     (benchmarks.kv_tiers runs it too)

The device KV is shrunk (SimConfig.num_blocks) so that a short run's working set exceeds
it; each replica's tiers are sized in proportion, at a DGX H200's ratios (2 TB of host
memory and 8 NVMe data drives of 3.84 TB for 8 GPUs, against ~110 GB of device KV each):
host tier HOST_SHARE x the device KV, disk DISK_SHARE x (far below the drive, and enough
for every working set here). The routers are benchmarks.routing's headroom policy and
limits (benchmarks/routing/setup.py); goodput is its SLO rate search (search.py).

  b2b       NUM_REPLICAS replicas; groups whose prefixes add up to WORKING_SET x the
            cluster's device KV; a warm-up request per group first (as benchmarks.routing);
            no session ids, so a router places a group by its prefix alone (with them,
            headroom's session affinity keeps each group on its replica whatever the
            reports say, and tier credit decides nothing).
            Goodput searches on the same seeded workload:
              device only | tiers, tier-aware routing          -> goodput_ratio_4x = tiers / device only
              behind NUM_INGRESS routers with private views: tiers, tier-aware | the same
              tiers, routers that credit only device-resident blocks (reports without
              tier fields)                                      -> tier_aware_vs_blind = aware / blind
            One router needs no tier fields: its own dispatch hints (routing_view.py, kept
            300 s) send each group back to the replica that served it, whose tiers hold
            it; aware and blind ran identical searches there. Behind several routers
            each knows a share of the dispatches, and the replicas' KV state decides the
            rest: the exact index the routers keep from the replicas' KV events.
            Then a what-if pair of searches: snapshots carrying every hash
            (SimConfig.max_report_hashes) instead of the worker's cap of the most recent
            MAX_PREFIX_HASHES per tier; with the index they count only where it rebuilds.
  agentic   AGENTIC_REPLICAS replicas, a smaller device KV (sessions' histories grow to
            ~16k tokens), sessions thinking AGENTIC_THINK_S between turns (tool calls, a
            user reading): the working set is the sessions in flight (rate x think time)
            times their histories, so with the workload's default 2 s it stays within the
            device KV at every rate the device serves, and later turns mostly hit the
            device either way. Device only's goodput search, then both at that rate:
            later_turn_ttft_ratio = p50 TTFT of turns 2+ with tiers / device only
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, replace

from benchmarks.routing.search import RunFigures, Runner, Search, Window, collector_paused
from benchmarks.routing.setup import (
    HEADROOM,
    MIN_REQUESTS,
    MAX_REQUESTS,
    QUICK,
    RATE_STEP,
    WARMUP_PREFILL_SHARE,
    B2B_WARMUP_MAX_TOKENS,
    log,
    modelled_prefill_tokens_per_s,
    sim_config,
)
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.sim.tiers import SimTierOptions
from cluster.workload.sim_kinds import AGENTIC_TURNS, B2B_PREFIX_LEN, B2B_QUESTION_LEN, make_workload

SEED = 0
HOST_SHARE = 2.0  # host tier / device KV (DGX H200: 256 GB of host memory per GPU / ~110 GB)
DISK_SHARE = 8.0  # disk tier / device KV
WORKING_SET = 4.0  # b2b: the groups' prefixes / the cluster's device KV
NUM_REPLICAS = 2
NUM_INGRESS = 4
WHAT_IF_REPORT_HASHES = 1 << 20  # more than any replica's device and tiers hold here
# b2b: 524k tokens a replica (an H200 holds ~850k of llama-3-8b). Smaller, the running
# batch itself runs out of KV (~70 requests of 7.5k tokens here) and caps the goodput of
# both sides alike, the tiers' included.
DEVICE_BLOCKS = 32_768
AGENTIC_REPLICAS = 2
AGENTIC_DEVICE_BLOCKS = 4_096  # 65k tokens a replica: a few sessions' histories
AGENTIC_THINK_S = 10.0
START_RPS_PER_REPLICA = {"b2b": 4.0, "agentic": 3.0}
WINDOW_S = {"b2b": 10.0, "agentic": 10.0}


@dataclass(frozen=True)
class Figures:
    later_turn_ttft_ratio: float
    goodput_ratio_4x: float
    tier_aware_vs_blind: float


def tier_options(config: SimConfig, device: SimDevice, route_on_tiers: bool = True) -> SimTierOptions:
    assert config.num_blocks is not None
    device_bytes = config.num_blocks * config.block_size * device.kv_bytes_per_token
    return SimTierOptions(host_bytes=int(HOST_SHARE * device_bytes), disk_bytes=int(DISK_SHARE * device_bytes),
                          route_on_tiers=route_on_tiers)


def b2b_workload_kw(config: SimConfig) -> dict:
    """Groups filling WORKING_SET x the cluster's device KV, warm-up as benchmarks.routing's."""
    assert config.num_blocks is not None
    kv_tokens = config.num_replicas * config.num_blocks * config.block_size
    groups = round(WORKING_SET * kv_tokens / B2B_PREFIX_LEN)
    warm_tokens = groups * (B2B_PREFIX_LEN + B2B_QUESTION_LEN)
    warmup_s = warm_tokens / (WARMUP_PREFILL_SHARE * config.num_replicas * modelled_prefill_tokens_per_s())
    return {"num_groups": groups, "warmup_s": round(warmup_s, 1), "warmup_max_tokens": B2B_WARMUP_MAX_TOKENS,
            "sessions": False}


def search_plan(quick: bool) -> Search:
    return QUICK.search if quick else Search(3, RATE_STEP, 6)


def cell(runner: Runner, name: str, config: SimConfig, start: float, search: Search,
         known_miss: float | None = None) -> RunFigures:
    t0 = time.perf_counter()
    fig = runner.goodput(config, start, search, known_miss)
    log(f"CELL {runner.workload:8s} {name:22s} goodput {'>=' if fig.lower_bound else '  '}{fig.goodput_rps:7.2f} "
        f"rate {fig.rate_rps:7.2f} ttft50 {fig.ttft_p50_s:.3f} ttft99 {fig.ttft_p99_s:.3f} hit {fig.hit_rate:.3f} "
        f"({time.perf_counter() - t0:.0f} s)")
    return fig


def b2b(quick: bool) -> tuple[float, float]:
    device_only = replace(sim_config(HEADROOM, NUM_REPLICAS), num_blocks=DEVICE_BLOCKS)
    device = SimDevice.from_config(device_only)
    aware = replace(device_only, tiers=tier_options(device_only, device))
    aware_n = replace(aware, num_ingress=NUM_INGRESS)
    blind_n = replace(aware_n, tiers=tier_options(device_only, device, route_on_tiers=False))
    kw = b2b_workload_kw(device_only)
    log(f"b2b: {NUM_REPLICAS} replicas x {DEVICE_BLOCKS} device blocks, {kw['num_groups']} groups of "
        f"{B2B_PREFIX_LEN} tokens ({WORKING_SET:g}x the device KV), warm-up {kw['warmup_s']} s; "
        f"tiers: host {aware.tiers.host_bytes / 2**30:.1f} GiB, disk {aware.tiers.disk_bytes / 2**30:.1f} GiB a replica")
    runner = Runner("b2b", SEED, Window(WINDOW_S["b2b"], MIN_REQUESTS, MAX_REQUESTS), kw, log)
    search = search_plan(quick)
    start = START_RPS_PER_REPLICA["b2b"] * NUM_REPLICAS
    base = cell(runner, "device only", device_only, start, search)
    with_tiers = cell(runner, "tiers, tier-aware", aware, base.rate_rps or start, search, base.bracket_top)
    start = with_tiers.rate_rps or start
    aware_fig = cell(runner, f"tiers, aware, {NUM_INGRESS} ingress", aware_n, start, search)
    blind_fig = cell(runner, f"tiers, blind, {NUM_INGRESS} ingress", blind_n, start, search, aware_fig.bracket_top)
    full = {}
    for name, config in (("aware", aware_n), ("blind", blind_n)):
        config = replace(config, max_report_hashes=WHAT_IF_REPORT_HASHES)
        full[name] = cell(runner, f"what-if {name}, every hash", config, start, search,
                          full["aware"].bracket_top if full else None)
    log(f"  what-if, reports with every hash, {NUM_INGRESS} ingress: aware / blind goodput "
        f"{ratio(full['aware'].goodput_rps, full['blind'].goodput_rps):.3f} (not a RESULT key: the worker caps "
        f"its report)")
    return ratio(with_tiers.goodput_rps, base.goodput_rps), ratio(aware_fig.goodput_rps, blind_fig.goodput_rps)


def agentic(quick: bool) -> float:
    device_only = replace(sim_config(HEADROOM, AGENTIC_REPLICAS), num_blocks=AGENTIC_DEVICE_BLOCKS)
    device = SimDevice.from_config(device_only)
    with_tiers = replace(device_only, tiers=tier_options(device_only, device))
    kw = {"warmup_s": AGENTIC_TURNS * AGENTIC_THINK_S, "think_s": AGENTIC_THINK_S}
    log(f"agentic: {AGENTIC_REPLICAS} replicas x {AGENTIC_DEVICE_BLOCKS} device blocks, {AGENTIC_TURNS} turns, "
        f"think {AGENTIC_THINK_S:g} s, warm-up {kw['warmup_s']} s")
    runner = Runner("agentic", SEED, Window(WINDOW_S["agentic"], MIN_REQUESTS, MAX_REQUESTS), kw, log)
    base = cell(runner, "device only", device_only, START_RPS_PER_REPLICA["agentic"] * AGENTIC_REPLICAS,
                search_plan(quick))
    rate = base.rate_rps or START_RPS_PER_REPLICA["agentic"] * AGENTIC_REPLICAS
    requests = make_workload("agentic", runner.window.num_requests(rate), rate, SEED, **kw)
    p50 = {}
    for name, config in (("device only", device_only), ("tiers", with_tiers)):
        with collector_paused():
            result = simulate(replace(config, seed=SEED), requests, device)
        later = [r.ttft_s for r in result.records
                 if not r.warmup and r.first_token_s is not None and not r.request_id.endswith("-0")]
        s = result.summary()
        p50[name] = statistics.median(later)
        log(f"  agentic at {rate:.2f} req/s, {name}: turns 2+ TTFT p50 {p50[name]:.3f} s ({len(later)} turns), "
            f"all TTFT p50 {s['ttft_s']['p50']:.3f} p99 {s['ttft_s']['p99']:.3f} s, hit {s['prefix_cache_hit_rate']:.3f}, "
            f"goodput {s['goodput_rps']:.2f} req/s")
    return ratio(p50["tiers"], p50["device only"])


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def run(quick: bool) -> Figures:
    t0 = time.perf_counter()
    later = agentic(quick)
    goodput, aware = b2b(quick)
    log(f"simulated parts done in {time.perf_counter() - t0:.0f} s")
    return Figures(later, goodput, aware)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two bisections of the rate bracket instead of three")
    args = parser.parse_args()
    f = run(args.quick)
    log(f"RESULT later_turn_ttft_ratio={f.later_turn_ttft_ratio:.3f} goodput_ratio_4x={f.goodput_ratio_4x:.3f} "
        f"tier_aware_vs_blind={f.tier_aware_vs_blind:.3f}")


if __name__ == "__main__":
    main()
