"""What-if runs on the router table's cluster: one router (or the ideal partition) at one
offered rate, on --quick's workload sizing, with the engine's chunk, the headroom router's
parameters or the step-time budget changed. For asking why a cell lands where it does; the
table itself is benchmarks/routing/table.py.

    python -m benchmarks.routing.probe agentic headroom 65.06 [--chunk 1024]
        [--param load_gate_threshold=1e9] [--step-time-budget-ms 0] [--moves]
    python -m benchmarks.routing.probe agentic partition 65.06

--step-time-budget-ms sets the engines' step-time budget (SchedulerConfig.max_step_time_s,
worker/scheduling/step_budget.py; the table's is routing_setup.MAX_STEP_TIME_S, 0 turns it off): a
step that carries decodes takes no more prefill tokens than keep its modelled time within
it; a step without decodes keeps the whole chunk. --moves reports the turns of a session
that landed on another replica than its previous turn, and the prefill work they carried.
"""
from __future__ import annotations

import argparse
import ast
import time
from dataclasses import replace

from benchmarks.routing.partition import run_partition
from benchmarks.routing.search import RunFigures, collector_paused
from benchmarks.routing.setup import HEADROOM, QUICK, sim_config, workload_kw
from cluster.sim.metrics import SimResult
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest, make_workload


def moved_turns(result: SimResult, requests: list[SimRequest]) -> str:
    """Session turns that landed on another replica than the session's previous turn, and
    the share of all uncached prompt tokens they carried (what leaving a cache costs)."""
    session = {r.request_id: r.session_id for r in requests}
    prompt = {r.request_id: len(r.prompt_token_ids) for r in requests}
    last: dict[object, object] = {}
    moved = total = moved_work = work = 0
    for rec in sorted(result.ok_records(), key=lambda r: r.arrival_s):
        replica = rec.replica_keys[-1] if rec.replica_keys else None
        sid = session.get(rec.request_id)
        uncached = prompt[rec.request_id] - (rec.num_cached_tokens or 0)
        total += 1
        work += uncached
        if sid is not None and sid in last and last[sid] != replica:
            moved += 1
            moved_work += uncached
        last[sid] = replica
    return (f"moved turns {moved} of {total}, carrying {moved_work} of {work} uncached prompt tokens "
            f"({moved_work / work if work else 0:.0%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing.probe", description=__doc__.split("\n")[0])
    parser.add_argument("workload")
    parser.add_argument("router", help="a router of the table, or 'partition' (the ideal partition)")
    parser.add_argument("rate", type=float, help="offered requests/s for the whole cluster")
    parser.add_argument("--replicas", type=int, default=QUICK.replicas[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, help="the scheduler's max_num_batched_tokens (default: the table's)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a RoutingParams field (repeatable)")
    parser.add_argument("--step-time-budget-ms", type=float,
                        help="the engines' step-time budget (see above; default: the table's, 0: none)")
    parser.add_argument("--moves", action="store_true", help="report session turns that changed replica")
    args = parser.parse_args(argv)

    overrides = {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in args.param)}

    def config_of(router: str, n: int) -> SimConfig:
        config = sim_config(router, n)
        if args.chunk is not None:
            config = replace(config, max_num_batched_tokens=args.chunk)
        if args.step_time_budget_ms is not None:
            config = replace(config, max_step_time_s=args.step_time_budget_ms / 1000.0 or None)
        if overrides:
            config = replace(config, policy_params=replace(config.policy_params, **overrides))
        return replace(config, seed=args.seed, stop_at_slo_miss=False)

    wkw = workload_kw(args.workload, args.replicas)
    cpu0 = time.process_time()
    if args.router == "partition":
        one = config_of(HEADROOM, 1)
        fig = run_partition(args.workload, args.replicas, args.seed, args.rate, QUICK, wkw,
                            SimDevice.from_config(one), config=one)
        extra = ""
    else:
        config = config_of(args.router, args.replicas)
        requests = make_workload(args.workload, QUICK.window_for(args.workload).num_requests(args.rate), args.rate,
                                 args.seed, **wkw)
        with collector_paused():
            result = simulate(config, requests, SimDevice.from_config(config))
        summary = result.summary()
        fig = RunFigures.from_summary(args.rate, summary, config.slo_ttft_ms / 1000.0, config.slo_itl_ms / 1000.0)
        modes = summary["routers"][0].get("modes") if summary.get("routers") else None
        extra = (f", TTFT p50 {summary['ttft_s']['p50']:.3f} s, modes {modes}"
                 + (f"; {moved_turns(result, requests)}" if args.moves else ""))
    changes = ", ".join(f for f in (f"chunk {args.chunk}" if args.chunk else "",
                                    f"params {overrides}" if overrides else "",
                                    f"step-time budget {args.step_time_budget_ms:g} ms" if args.step_time_budget_ms is not None else "")
                        if f) or "the table's settings"
    print(f"{args.workload} x{args.replicas} {args.router} @ {args.rate:g} req/s ({changes}): "
          f"{'meets' if fig.meets_slo else 'misses'} the SLO, TTFT p99 {fig.ttft_p99_s:.3f} s, "
          f"ITL p99 {1000 * fig.itl_p99_s:.1f} ms, hit {fig.hit_rate:.3f}{extra} "
          f"({time.process_time() - cpu0:.0f} s CPU)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
