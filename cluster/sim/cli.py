"""`kvserve simulate`: one discrete-event simulation from the command line.

    kvserve simulate --shape llama-3-8b --profile h200 --replicas 8 --router headroom \\
        --workload b2b --requests 2000 --rate 40 --seed 0 --json --plot out.png
    kvserve simulate --prefill-replicas 2 --decode-replicas 6 --workload code --rate 2
    kvserve simulate --autoscale --min-replicas 1 --max-replicas 16 --workload bursty
    kvserve simulate --planner --slo-ttft-ms 3000 --slo-itl-ms 35 --workload bursty   # the SLO planner
    kvserve simulate --router headroom --workload agentic --num-blocks 4096 --host-kv-cache-gib 16

Prints a short report (or the summary as JSON with --json); --plot writes a PNG of
per-replica queue depth and KV usage over time (needs matplotlib).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cluster.planner.targets import PlannerSettings, SLOTargets
from cluster.sim.autoscale import AutoscaleOptions
from cluster.sim.planner import SimPlannerOptions
from cluster.sim.disagg import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY_S,
    DisaggOptions,
)
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.sim.serving_cost import ServingCost, describe
from cluster.sim.lora import SimLoRA
from cluster.sim.tiers import SimTierOptions
from cluster.workload.sim_kinds import WORKLOAD_NAMES, make_workload
from worker.config import LoRAConfig

_DEFAULTS = SimConfig()
_LORA = LoRAConfig()
_AUTOSCALE = AutoscaleOptions()


def register(subparsers: Any) -> None:
    from router.routing.policies import SIM_POLICY_NAMES

    p = subparsers.add_parser("simulate", help="discrete-event simulation of a cluster (virtual clock, no Ray)")
    p.add_argument("--shape", default=_DEFAULTS.shape, help="model shape name or config.json (default %(default)s)")
    p.add_argument("--profile", default=_DEFAULTS.profile, help="device profile name or JSON (default %(default)s)")
    p.add_argument("--replicas", type=int, default=_DEFAULTS.num_replicas, help="mixed-pool replicas")
    p.add_argument("--router", default=_DEFAULTS.router, choices=SIM_POLICY_NAMES)
    p.add_argument("--ingress", type=int, default=_DEFAULTS.num_ingress, help="ingress routers")
    p.add_argument("--ingress-assignment", default=_DEFAULTS.ingress_assignment, choices=("round_robin", "session"))
    p.add_argument("--shared-view", action="store_true",
                   help="ingress routers share one routing view (as through Redis); default: a private view each")
    p.add_argument("--shared-view-rtt-ms", type=float, default=_DEFAULTS.shared_view_rtt_s * 1000,
                   help="with --shared-view: a router's writes reach the others this much later")
    p.add_argument("--workload", default="sharegpt", choices=WORKLOAD_NAMES)
    p.add_argument("--trace", metavar="JSONL", help="the trace workload's file")
    p.add_argument("--max-loras", type=int, default=_LORA.max_loras,
                   help="the lora workload: adapter slots per replica (default %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, help="the lora workload: adapters in host memory per replica "
                                                     "(default: --max-loras)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=10.0, help="mean arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--stats-period-s", type=float, default=_DEFAULTS.stats_period_s)
    p.add_argument("--report-lag-s", type=float, default=_DEFAULTS.report_lag_s)
    p.add_argument("--max-ongoing-requests", type=int, default=_DEFAULTS.max_ongoing_requests)
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--max-step-time-ms", type=float,
                   help="the engines' step-time budget: a step carrying decodes takes no more prefill than fits")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="0: the shape's max_position_embeddings (llama-3-8b: 8192; the code workload needs more)")
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    p.add_argument("--num-blocks", type=int, help="KV blocks per replica (default: from memory and shape)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=_DEFAULTS.kv_cache_dtype,
                   help="the replicas' KV element type: fp8 holds twice bf16's tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=_DEFAULTS.slo_ttft_ms)
    p.add_argument("--slo-itl-ms", type=float, default=_DEFAULTS.slo_itl_ms)
    p.add_argument("--prefill-replicas", type=int, default=0, help="disaggregate: prefill pool size")
    p.add_argument("--decode-replicas", type=int, default=0, help="disaggregate: decode pool size")
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_BANDWIDTH * 8 / 1e9,
                   help="KV transfer link, Gbit/s (default %(default)g)")
    p.add_argument("--link-latency-ms", type=float, default=DEFAULT_LINK_LATENCY_S * 1000)
    p.add_argument("--host-kv-cache-gib", type=float, default=0.0,
                   help="KV tiers: host memory per replica for blocks evicted from the device (0: no tiers)")
    p.add_argument("--disk-kv-cache-gib", type=float, default=0.0, help="KV tiers: a local disk per replica")
    p.add_argument("--shared-kv-store-gib", type=float, default=0.0, help="KV tiers: one store all replicas share")
    p.add_argument("--shared-kv-store-gbps", type=float, default=0.0,
                   help="the shared store's bandwidth, Gbit/s, reads and writes together")
    p.add_argument("--tier-blind-routing", action="store_true",
                   help="routers ignore the reports' tier fields (credit device-resident blocks only)")
    p.add_argument("--serve-proxy", action="store_true",
                   help="plan the serving layer's cores as `kvserve serve --serve-proxy` runs it (Serve's proxies); "
                        "default: as `kvserve serve` runs it, through direct ingress (HAProxy)")
    p.add_argument("--autoscale", action="store_true", help="scale each pool with the real policy")
    p.add_argument("--planner", action="store_true",
                   help="size each pool with the SLO planner (cluster/planner/) for --slo-ttft-ms / --slo-itl-ms "
                        "at --slo-percentile; bounds and start-up as for --autoscale")
    p.add_argument("--slo-percentile", type=float, default=90.0, help="the planner's TTFT and ITL percentile")
    p.add_argument("--scale-to-zero", action="store_true", help="with --planner: an idle pool may go to zero")
    p.add_argument("--min-replicas", type=int, default=_AUTOSCALE.min_replicas)
    p.add_argument("--max-replicas", type=int, default=_AUTOSCALE.max_replicas)
    p.add_argument("--startup-delay-s", type=float, default=_AUTOSCALE.startup_delay_s)
    p.add_argument("--autoscale-interval-s", type=float, default=_AUTOSCALE.interval_s)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timelines", action="store_true", help="with --json: per-replica queue depth / KV usage samples")
    p.add_argument("--plot", metavar="PNG", help="write per-replica queue depth and KV usage over time")
    p.set_defaults(func=run)


def planner_from_args(args: argparse.Namespace) -> SimPlannerOptions | None:
    """The SLO planner's options (--planner), from the run's SLO and autoscaling flags."""
    if not getattr(args, "planner", False):
        return None
    slo = SLOTargets(args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0, args.slo_percentile, args.slo_percentile)
    settings = PlannerSettings(startup_s=args.startup_delay_s, interval_s=args.autoscale_interval_s)
    minimum = 0 if args.scale_to_zero else args.min_replicas
    return SimPlannerOptions(slo, settings, minimum, args.max_replicas, scale_to_zero=args.scale_to_zero)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    autoscale = None
    if args.autoscale:
        autoscale = AutoscaleOptions(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                     startup_delay_s=args.startup_delay_s, interval_s=args.autoscale_interval_s)
    return SimConfig(
        planner=planner_from_args(args),
        shape=args.shape, profile=args.profile, num_replicas=args.replicas, router=args.router,
        num_ingress=args.ingress, ingress_assignment=args.ingress_assignment,
        shared_view=args.shared_view, shared_view_rtt_s=args.shared_view_rtt_ms / 1000.0,
        stats_period_s=args.stats_period_s, report_lag_s=args.report_lag_s,
        max_ongoing_requests=args.max_ongoing_requests, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_time_s=args.max_step_time_ms / 1000.0 if args.max_step_time_ms else None,
        max_model_len=args.max_model_len, num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype,
        slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
        disagg=DisaggOptions(args.prefill_replicas, args.decode_replicas, args.link_gbps * 1e9 / 8,
                             args.link_latency_ms / 1000),
        tiers=SimTierOptions(int(args.host_kv_cache_gib * 2**30), int(args.disk_kv_cache_gib * 2**30),
                             int(args.shared_kv_store_gib * 2**30), args.shared_kv_store_gbps * 1e9 / 8,
                             route_on_tiers=not args.tier_blind_routing),
        autoscale=autoscale, seed=args.seed,
        lora=SimLoRA(LoRAConfig(enable=True, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras))
        if args.workload == "lora" else None,
        policy_options=(("max_loras", args.max_loras),) if args.router == "lora_affinity" else (),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        kw = {"path": args.trace} if args.workload == "trace" else {}
        requests = make_workload(args.workload, args.requests, args.rate, args.seed, **kw)
        serving_cost = ServingCost.load().path(args.serve_proxy)
    except ValueError as e:
        print(f"kvserve simulate: {e}", file=sys.stderr)
        return 2
    if args.plot:
        _check_matplotlib()
    start = time.perf_counter()
    try:
        result = simulate(config, requests)
    except ValueError as e:  # a config the device cannot serve (e.g. tiers on a profile without links)
        print(f"kvserve simulate: {e}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - start
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(result.to_json(timelines=args.timelines))
    else:
        _print_report(result.summary(), args, wall_s, serving_cost)
    return 0


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("kvserve simulate --plot needs matplotlib: pip install matplotlib") from None


def _print_report(s: dict[str, Any], args: argparse.Namespace, wall_s: float, serving_cost: ServingCost) -> None:
    def pct(key: str) -> str:
        v = s[key]
        return f"p50 {v['p50'] * 1000:.1f}  p90 {v['p90'] * 1000:.1f}  p99 {v['p99'] * 1000:.1f} ms"

    print(f"{args.workload}: {s['num_requests']} requests at {args.rate:g}/s, router {args.router}, "
          f"{s['num_replicas_created']} replicas ({args.shape} on {args.profile})")
    print(f"  TTFT  {pct('ttft_s')}")
    print(f"  ITL   {pct('itl_s')}")
    print(f"  E2E   {pct('e2e_s')}")
    print(f"  output {s['output_tokens_per_s']:.0f} tok/s   goodput {s['goodput_rps']:.2f} req/s "
          f"({s['goodput_fraction']:.1%} within TTFT {s['slo_ttft_ms']:g} ms, ITL {s['slo_itl_ms']:g} ms)")
    for streamed in (True, False):
        plan = serving_cost.plan(s["output_tokens_per_s"], s["num_replicas_created"], streamed)
        print(f"  {describe(plan, streamed, args.serve_proxy)}")
    print(f"  prefix-cache hit rate {s['prefix_cache_hit_rate']:.1%}   preemptions {s['num_preemptions']}   "
          f"load imbalance {s['load_imbalance']:.2f}   rejected {s['num_rejected']}")
    if args.host_kv_cache_gib:
        print(f"  KV tiers: {s['num_tier_loaded_blocks']} blocks loaded instead of recomputed")
    if s["num_rejected"]:
        print(f"  {s['num_rejected']} requests rejected by the engine, e.g.: {s['rejection_example']}")
        if "max_model_len" in str(s["rejection_example"]):
            print("  (--max-model-len serves longer prompts, e.g. 131072 for Llama 3.1's context; agentic "
                  "histories reach ~16k tokens, code prompts 64k)")
    print(f"  simulated {s['duration_s']:.1f} s in {wall_s:.1f} s wall ({s['num_events']} events)")
