"""The router table on simulated H200s, plus the simulator's two validations.

    python -m benchmarks.routing [--quick] [--skip-validation] [--trace FILE.jsonl | --no-trace]

1. Router table (cluster/sim: the real engine, scheduler, KV manager and routing policies on
   a virtual clock; worker/sim: the H200 step-cost model, llama-3-8b shape): for every
   workload, replica count and seed, each router's offered rate is searched for the highest
   rate that meets the SLO (TTFT p99 <= 2 s, ITL p99 <= 100 ms; benchmarks/routing/search.py);
   its goodput there is the table's figure (mean over seeds). Then every router runs at 80%
   of round robin's rate: TTFT p99, prefix-cache hit rate, load imbalance there.
   Trace cells: the Mooncake conversation trace (benchmarks/traces/) at Plan.trace_replicas,
   arrivals scaled to each searched rate; a run meets the SLO at TRACE_ATTAINMENT of its
   requests within both targets (its long prompts put the TTFT p99 out of reach). --quick's
   trace cells run the goodput search only (Plan.trace_at_80).
2. Multi-ingress rows: headroom on b2b behind 1 ingress router (the table's cell) and behind
   4, each with a private view (the herding failure) or all sharing one view (what Redis
   shares in a deployment: SimConfig.shared_view); headroom_share is 1.0 in every case.
   The ideal partition beside them (b2b, agentic; benchmarks/routing/partition.py): the same
   requests with every session or group dealt to one replica for good, each replica simulated
   alone: the yardstick for cache-aware routing.
3. Validations (benchmarks/routing/validate.py, validate_cluster.py): the real CPU
   engine vs the simulator with the calibrated CPU profile; a real Serve cluster of 8
   simulated-device replicas vs the simulator. Relative errors of TTFT p50, TTFT p99 and output tokens/s.
   The cluster's runs beside the table (they mostly wait on the wall clock; the table's
   processes yield to them), the engine's after it, alone.

What is simulated (routers, workloads, the cluster, the plans): benchmarks/routing/setup.py.

Last line: RESULT sim_error_pct=... headroom_goodput_vs_rr=... headroom_goodput_vs_best=...
multi_ingress_goodput_ratio=... trace_goodput_vs_best=... (see the issues for the definitions;
headroom_goodput_vs_best over the synthetic cells, trace_goodput_vs_best over the trace's).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    wait,
)
from dataclasses import dataclass

from benchmarks.routing.partition import partition_goodput
from benchmarks.routing.validate import ClusterValidation
from benchmarks.routing.search import RunFigures, Runner
from benchmarks.routing.setup import (
    AT_FRACTION,
    BASELINE,
    FULL,
    HEADROOM,
    NUM_INGRESS,
    PARTITION_WORKLOADS,
    PROFILE,
    QUICK,
    QUICK_JOBS,
    ROUTERS,
    SHAPE,
    START_RPS_PER_REPLICA,
    TRACE,
    WORKLOADS,
    Plan,
    log,
    modelled_prefill_tokens_per_s,
    sim_config,
    slo_attainment,
    workload_kw,
)


@dataclass
class Cell:
    """One (workload, replicas, router): figures per seed."""

    at_slo: list[RunFigures]
    at_80: list[RunFigures]

    def goodput(self) -> float:
        """Goodput at the SLO: the highest offered rate whose run met the SLO (DistServe's
        definition, the rate a cluster sustains within its latency targets), mean over seeds."""
        return statistics.fmean(f.rate_rps if f.meets_slo else 0.0 for f in self.at_slo)

    def attained(self) -> float:
        """What that run measured: requests/s that met both SLOs per request, over the run
        (arrivals through the last finish, so a finite run's drain lowers it)."""
        return statistics.fmean(f.goodput_rps for f in self.at_slo)

    def lower_bound(self) -> bool:
        return any(f.lower_bound for f in self.at_slo)

    def mean(self, name: str) -> float:
        values = [getattr(f, name) for f in self.at_80]
        return statistics.fmean(values) if values else math.nan


@dataclass(frozen=True)
class CellResult:
    """One router's search on one (workload, replicas, seed), and its run at 80% of round robin's goodput."""

    workload: str
    num_replicas: int
    seed: int
    router: str
    at_slo: RunFigures
    at_80: RunFigures | None
    cpu_s: float


def router_cell(workload: str, num_replicas: int, seed: int, plan: Plan, wkw: dict, router: str,
                start: float | None = None, known_miss: float | None = None,
                at_rate: float | None = None) -> CellResult:
    """One router's goodput search (from `start`, default the workload's START rate; trying
    round robin's bracket top `known_miss` first), then its run at `at_rate` (default: 80%
    of the goodput it found; round robin's task sets everyone's). One process task."""
    runner = Runner(workload, seed, plan.window_for(workload), wkw, log, slo_attainment(workload))
    t0, cpu0 = time.perf_counter(), time.process_time()
    config = sim_config(router, num_replicas)
    start = start or START_RPS_PER_REPLICA[workload] * num_replicas
    fig = runner.goodput(config, start, plan.search, known_miss)
    at = at_rate if at_rate is not None else AT_FRACTION * fig.rate_rps
    if workload == TRACE and not plan.trace_at_80:
        at = 0.0
    at_80 = runner.run(config, at, stop_at_slo_miss=False) if at > 0 else None
    cpu_s = time.process_time() - cpu0
    log(f"  {workload} x{num_replicas} seed {seed} {router}: {runner.num_runs} simulations in "
        f"{time.perf_counter() - t0:.0f} s ({cpu_s:.0f} s CPU)")
    return CellResult(workload, num_replicas, seed, router, fig, at_80, cpu_s)


Key = tuple[str, int]  # (workload, replicas)
# The table's processes yield the CPU to validation 2's (Serve replicas, proxy, driver; Ray
# workers at nice 0, routing_validate_cluster.py), which run beside them on the wall clock.
TABLE_NICE = 19
# Validation 2 takes ~2.5 minutes; past this its result is given up for (a hung cluster).
CLUSTER_VALIDATION_TIMEOUT_S = 900.0


def run_table(pool: Executor, keys: list[Key], plan: Plan, kw_of: dict[str, dict]
              ) -> tuple[dict[Key, dict[str, Cell]], float, dict[bool, list[float]], dict[Key, list[float]]]:
    """Every cell of the table as its own task: round robin's search per (workload, replicas,
    seed) first; when one ends, the other routers' tasks for it, each starting at round
    robin's goodput (every router walks the same grid of rates: round robin's start x 1.5^k,
    so that no router is compared on a coarser ladder than another) with round robin's
    bracket top as its first step up and round robin's 80% rate. Tasks of unequal length
    keep every process busy. b2b at the first replica count also gets the multi-ingress
    searches: a private view anchored the same way, the shared one on headroom's cell.
    PARTITION_WORKLOADS also get the ideal partition's search (routing_partition.py), from
    headroom's goodput once its cell is done.
    Returns the cells, their CPU seconds, the multi-ingress goodputs per seed by view, and
    the ideal partition's goodputs per seed."""
    rows: dict[Key, dict[str, Cell]] = {key: {r: Cell([], []) for r in ROUTERS} for key in keys}
    ingress: dict[bool, list[float]] = {False: [], True: []}
    partition: dict[Key, list[float]] = {}
    pending: dict[Future, object] = {}
    # Round robin's searches go in longest chain first: the cache-aware workloads' other
    # routers climb several rungs past it, and queued last they would leave one process
    # idle at the end (the table keeps `keys` order).
    for workload, n in sorted(keys, key=lambda key: key[0] not in PARTITION_WORKLOADS):
        wkw = kw_of[workload] or workload_kw(workload, n)
        for seed in plan.seeds:
            pending[pool.submit(router_cell, workload, n, seed, plan, wkw, BASELINE)] = wkw
    cpu_s = 0.0
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            tag = pending.pop(future)
            if isinstance(tag, bool):  # a multi-ingress search: its view
                ingress[tag].append(future.result())
                continue
            if isinstance(tag, tuple):  # the ideal partition's search: its (workload, replicas)
                goodput, search_cpu_s = future.result()
                partition.setdefault(tag, []).append(goodput)
                cpu_s += search_cpu_s
                continue
            res: CellResult = future.result()
            cpu_s += res.cpu_s
            cell = rows[(res.workload, res.num_replicas)][res.router]
            cell.at_slo.append(res.at_slo)
            if res.at_80 is not None:
                cell.at_80.append(res.at_80)
            multi_ingress = res.workload == "b2b" and res.num_replicas == plan.replicas[0]
            if multi_ingress and res.router == HEADROOM:
                # The shared view is measured against one router: its search starts at that
                # router's goodput, with its first miss as the step up (2 runs when they tie,
                # not the 7 a climb from round robin's rate takes; the same grid of rates).
                one = res.at_slo
                pending[pool.submit(multi_ingress_goodput, plan, res.seed, True, one.rate_rps or None,
                                    one.bracket_top)] = True
            if res.router == HEADROOM and res.workload in PARTITION_WORKLOADS and res.at_slo.rate_rps > 0:
                # From headroom's goodput, its first miss the step up: two runs when they tie.
                pending[pool.submit(partition_goodput, res.workload, res.num_replicas, res.seed, plan, tag,
                                    res.at_slo.rate_rps, res.at_slo.bracket_top, log)] = (res.workload, res.num_replicas)
            if res.router != BASELINE:
                continue
            rr = res.at_slo
            known_miss = rr.bracket_top
            if multi_ingress:  # private views herd below one router: searched up from round robin's
                pending[pool.submit(multi_ingress_goodput, plan, res.seed, False, rr.rate_rps or None,
                                    known_miss)] = False
            for router in ROUTERS[1:]:
                pending[pool.submit(router_cell, res.workload, res.num_replicas, res.seed, plan, tag, router,
                                    rr.rate_rps or None, known_miss, AT_FRACTION * rr.rate_rps)] = tag
    return rows, cpu_s, ingress, partition


def print_partition(rows: dict[Key, dict[str, Cell]], partition: dict[Key, list[float]]) -> None:
    log("")
    log("Ideal partition (the same requests, each session or group dealt to one replica for good, each replica "
        "simulated alone; benchmarks/routing/partition.py): a yardstick, not a bound")
    for (workload, n), goodputs in partition.items():
        ideal = statistics.fmean(goodputs)
        cells = rows[(workload, n)]
        shares = "  ".join(f"{router} {cells[router].goodput() / ideal:.0%}" for router in ROUTERS) if ideal > 0 else ""
        log(f"  {workload:<9} {n:>3}: {ideal:7.2f} req/s = {ideal / cells[BASELINE].goodput():.2f} x round robin; "
            f"each router's share of it: {shares}")


def full_table_cpu_s(quick_cpu_s: float) -> float:
    """The full table's CPU seconds, scaled from the quick table's measured CPU: a run's cost
    grows with the tokens it simulates (replicas x arrival window at a rate near capacity),
    times the runs per cell (the quick ladder's ~2.5 search runs + 1 at 80%, plus
    FULL.bisect_steps), times the seeds. An estimate (the capacity per replica does not
    depend on N, so rates and tokens scale with N), not a measurement."""
    replicas = sum(FULL.replicas) / sum(QUICK.replicas)
    full, quick = dict(FULL.window_s), dict(QUICK.window_s)
    window = statistics.fmean(full[w] / quick[w] for w in WORKLOADS)  # each workload's own ratio
    runs = (3.5 + FULL.bisect_steps) / (3.5 + QUICK.bisect_steps)
    return quick_cpu_s * replicas * window * runs * len(FULL.seeds) / len(QUICK.seeds)


def print_table(rows: dict[tuple[str, int], dict[str, Cell]]) -> None:
    log("")
    log(f"Router table: simulated {PROFILE.upper()} x N, {SHAPE}, SLO TTFT p99 <= 2 s and ITL p99 <= 100 ms; "
        f"goodput = the highest offered req/s whose run meets the SLO p99s (mean over seeds); good/s = what "
        f"that run measured meeting both SLOs per request; TTFT p99 / hit rate / imbalance at {AT_FRACTION:.0%} "
        f"of round robin's goodput")
    log(f"{'workload':<9} {'N':>3} {'router':<16} {'goodput':>8} {'vs rr':>6} {'good/s':>8} "
        f"{'ttft99@80':>9} {'hit':>6} {'imbal':>6}")
    for (workload, n), cells in rows.items():
        rr = cells[BASELINE].goodput()
        for router, cell in cells.items():
            g = cell.goodput()
            mark = ">=" if cell.lower_bound() else ""
            log(f"{workload:<9} {n:>3} {router:<16} {mark + f'{g:.2f}':>8} {g / rr if rr > 0 else math.nan:>6.2f} "
                f"{cell.attained():>8.2f} {cell.mean('ttft_p99_s'):>9.3f} {cell.mean('hit_rate'):>6.3f} "
                f"{cell.mean('imbalance'):>6.3f}")


def multi_ingress_goodput(plan: Plan, seed: int, shared_view: bool, start: float | None = None,
                          known_miss: float | None = None) -> float:
    """Headroom's goodput on b2b behind NUM_INGRESS ingress routers, each with a private view
    or all sharing one (one seed; searched like the table's cells, from `start`: round
    robin's goodput for private views, one router's for the shared one)."""
    n = plan.replicas[0]
    runner = Runner("b2b", seed, plan.window_for("b2b"), workload_kw("b2b", n), log)
    config = sim_config(HEADROOM, n, num_ingress=NUM_INGRESS, shared_view=shared_view)
    fig = runner.goodput(config, start or START_RPS_PER_REPLICA["b2b"] * n, plan.search, known_miss)
    return fig.rate_rps if fig.meets_slo else 0.0


def print_multi_ingress(n: int, one: float, private: float, shared: float) -> None:
    log("")
    log(f"Multi-ingress: headroom on b2b, {n} replicas, goodput at the SLO (headroom_share 1.0 everywhere)")
    log(f"  1 ingress router:                                {one:7.2f} req/s")
    log(f"  {NUM_INGRESS} ingress routers, a private view each (herding): {private:7.2f} req/s")
    log(f"  {NUM_INGRESS} ingress routers sharing one view (Redis):      {shared:7.2f} req/s")


def start_cluster_validation(pool: Executor, quick: bool) -> Callable[[], ClusterValidation]:
    """Validation 2 submitted to its own process; the returned call waits for its result (a
    died or hung process reads as a failed validation, with its traceback)."""
    from benchmarks.routing.validate import validate_cluster_buffered

    future = pool.submit(validate_cluster_buffered, quick)

    def result() -> ClusterValidation:
        try:
            return future.result(timeout=CLUSTER_VALIDATION_TIMEOUT_S)
        except Exception:
            return None, [], traceback.format_exc()

    return result


def header(argv: list[str]) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = "?"
    log(f"command: python -m benchmarks.routing {' '.join(argv)}")
    log(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    log(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} (shared with other jobs)")
    log(f"commit: {commit}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 replicas, 10-60 s of arrivals a run, no bisection")
    parser.add_argument("--skip-validation", action="store_true", help="the router table only")
    parser.add_argument("--trace", metavar="FILE",
                        help="the trace cells replay this Mooncake-style JSONL trace (default: benchmarks/traces/'s)")
    parser.add_argument("--no-trace", action="store_true", help="no trace cells")
    parser.add_argument("--cpu-profile", metavar="FILE",
                        help="validation 1: a calibrated CPU profile (default: calibrate now)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--jobs", type=int, default=0,
                        help=f"parallel processes (default: {QUICK_JOBS} with --quick, else one per CPU)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    header(argv)
    t0 = time.perf_counter()

    workloads = [w for w in args.workloads.split(",") if w]
    kw_of = {w: {} for w in workloads}
    # Every cell and the multi-ingress searches run in parallel processes (independent seeded
    # simulations; the log interleaves their progress lines).
    keys = [(w, n) for n in plan.replicas for w in workloads]
    if not args.no_trace:
        kw_of[TRACE] = {"path": args.trace, "scale_to_rate": True} if args.trace else {}
        keys += [(TRACE, n) for n in plan.trace_replicas]
    jobs = args.jobs or (QUICK_JOBS if args.quick else os.cpu_count() or 1)
    log(f"sticky's prefill_tokens_per_s (cost model, {PROFILE}, {SHAPE}): {modelled_prefill_tokens_per_s():.0f}")
    # Validation 2 (a real Serve cluster, mostly asleep on dilated steps) runs beside the
    # table: its ~2.5 minutes of wall clock cost the table ~1 minute of one core's CPU.
    # Validation 1 (a real engine computing flat out on the wall clock) runs alone after.
    validation_pool = None if args.skip_validation else ProcessPoolExecutor(max_workers=1)
    try:
        cluster_result = start_cluster_validation(validation_pool, args.quick) if validation_pool else None
        # Nothing to yield to without validation 2: the table keeps the nice it was started at.
        nice = TABLE_NICE if validation_pool is not None else 0
        with ProcessPoolExecutor(max_workers=jobs, initializer=os.nice, initargs=(nice,)) as pool:
            rows, table_cpu_s, ingress_runs, partition = run_table(pool, keys, plan, kw_of)
        log(f"router table done at {time.perf_counter() - t0:.0f} s")
        ingress = {shared: statistics.fmean(v) for shared, v in ingress_runs.items() if v}
        print_table(rows)
        print_partition(rows, partition)
        one = rows[("b2b", plan.replicas[0])][HEADROOM].goodput() if ingress else math.nan
        if ingress:
            print_multi_ingress(plan.replicas[0], one, ingress[False], ingress[True])

        log(f"\nrouter table: {table_cpu_s:.0f} s of simulation CPU"
            + (f"; the full table (replicas {FULL.replicas}, {len(FULL.seeds)} seeds, "
               f"{dict(FULL.window_s)['sharegpt']:g} s windows, {FULL.bisect_steps} bisection steps) would take "
               f"~{full_table_cpu_s(table_cpu_s) / 3600:.0f} CPU-hours by the same measure (wall: that / the cores "
               f"given to --jobs)" if args.quick else ""))
        sim_error = math.nan
        if cluster_result is not None:
            from benchmarks.routing.validate import validate_all

            sim_error = validate_all(args.quick, args.cpu_profile, log, cluster_result)
    finally:  # an error in the table does not wait for validation 2 to finish
        if validation_pool is not None:
            validation_pool.shutdown(wait=False, cancel_futures=True)

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else math.nan

    # A workload where no router meets the SLO at any rate tried has no ratio (0 / 0): left out.
    vs_rr = [x for (w, _), c in rows.items() if w in ("b2b", "agentic")
             if not math.isnan(x := ratio(c[HEADROOM].goodput(), c[BASELINE].goodput()))]
    def vs_best(trace: bool) -> list[float]:
        return [x for (w, _), c in rows.items() if (w == TRACE) == trace
                if not math.isnan(x := ratio(c[HEADROOM].goodput(),
                                             max(c[r].goodput() for r in ROUTERS if r != HEADROOM)))]

    log(f"\nwall time {time.perf_counter() - t0:.0f} s")
    log(f"RESULT sim_error_pct={sim_error:.1f} headroom_goodput_vs_rr={min(vs_rr, default=math.nan):.3f} "
        f"headroom_goodput_vs_best={min(vs_best(False), default=math.nan):.3f} "
        f"multi_ingress_goodput_ratio={ratio(ingress.get(True, math.nan), one):.3f} "
        f"trace_goodput_vs_best={min(vs_best(True), default=math.nan):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
