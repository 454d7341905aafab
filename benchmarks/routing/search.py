"""Goodput at an SLO for one router: the highest offered rate whose run meets the SLO.

Each run offers `rate x window_s` requests (clamped to [min_requests, max_requests]): a
fixed request count would let a high rate arrive as one burst that the replicas' batch
slots absorb, so the run would never reach the steady state whose queueing the SLO is
about; a fixed arrival window does.

A run "meets the SLO" when its TTFT p99 <= slo_ttft and its ITL p99 <= slo_itl (the
issue's definition: percentiles over the run, not per request). Goodput is then the
run's own goodput (requests/s that met both, cluster/sim/metrics.py) at that rate.

Search: from a starting rate, step geometrically (x / `step`) until the SLO flips, then
bisect the bracket (geometric midpoints) until it is as narrow as `bisect_steps` halvings
of one step make it (`Search.resolution`). A search may be told a rate above its start
that another router's search saw miss (`known_miss`): it tries that rate first, so a
router exactly as good as round robin costs two runs and lands on round robin's grid,
instead of stepping out and bisecting back to the same bracket; a better one skips the
start. Every run is one seeded
simulation; the same seed gives the same workload shape at every rate (arrivals scale).
"""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import make_workload

# Stepping down: a miss whose shortfall (RunFigures.shortfall: its TTFT p99, or its share
# outside the SLO) is not at least this much lower than the previous miss's ends the search (queueing is not the cause, so no rate will meet the SLO).
NO_RELIEF = 0.05


@dataclass(frozen=True)
class RunFigures:
    rate_rps: float
    meets_slo: bool
    goodput_rps: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_s: float
    output_tokens_per_s: float
    hit_rate: float
    imbalance: float
    # The search never reached a rate that misses the SLO: the goodput is a lower bound.
    lower_bound: bool = False
    # The run ended once its TTFT p99 was sure to miss (SimConfig.stop_at_slo_miss): its
    # other figures cover the run until then.
    stopped: bool = False
    # The lowest rate the search saw miss above this one (nan: none): the bracket's top.
    next_miss_rps: float = math.nan
    # Share of the requests that met both targets, and whether that share (not the p99s)
    # judged the run (Runner.attainment).
    within_share: float = math.nan
    by_attainment: bool = False

    @property
    def shortfall(self) -> float:
        """How far the run missed, in the measure that judged it: its TTFT p99, or the share
        of requests outside the SLO. A lower rate that does not lower it is no relief."""
        return 1.0 - self.within_share if self.by_attainment else self.ttft_p99_s

    @property
    def bracket_top(self) -> float | None:
        """next_miss_rps, None when the search saw no miss above (what another search takes as
        its `known_miss`)."""
        return None if math.isnan(self.next_miss_rps) else self.next_miss_rps

    @classmethod
    def from_summary(cls, rate: float, s: dict[str, Any], slo_ttft_s: float, slo_itl_s: float,
                     attainment: float | None = None) -> RunFigures:
        """`attainment`: the run meets the SLO when at least this share of its requests met
        both targets (DistServe's SLO attainment) instead of when its p99s did."""
        ttft99, itl99 = s["ttft_s"]["p99"], s["itl_s"]["p99"]
        within = (s["goodput_fraction"] >= attainment if attainment is not None
                  else ttft99 <= slo_ttft_s and itl99 <= slo_itl_s)
        ok = s["num_finished"] == s["num_requests"] and within
        return cls(rate, ok, s["goodput_rps"], s["ttft_s"]["p50"], ttft99, itl99, s["output_tokens_per_s"],
                   s["prefix_cache_hit_rate"], s["load_imbalance"], stopped=s["stopped_at_slo_miss"],
                   within_share=s["goodput_fraction"], by_attainment=attainment is not None)


@dataclass(frozen=True)
class Search:
    """How hard to look."""

    bisect_steps: int
    step: float = 2.0
    max_steps_out: int = 6  # geometric steps before giving up on finding the flip

    @property
    def resolution(self) -> float:
        """The bracket ratio (hi / lo) the search stops at: one step, halved (geometrically)
        bisect_steps times."""
        return self.step ** (0.5 ** self.bisect_steps)


@dataclass(frozen=True)
class Window:
    """How many requests a run at a given rate offers."""

    window_s: float
    min_requests: int
    max_requests: int

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, min(self.max_requests, round(rate * self.window_s)))


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for a simulation, one collection after it: a simulation
    allocates an output object per token and keeps ~0.5 GB of blocks and sequences that
    every full collection walks (5% of a run's CPU, same peak memory)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


class Runner:
    """Runs (workload, rate, config) points, building each replica device once per config."""

    def __init__(self, workload: str, seed: int, window: Window, workload_kw: dict[str, Any] | None = None,
                 log: Callable[[str], None] | None = None, attainment: float | None = None) -> None:
        self.log = log
        self.attainment = attainment  # RunFigures.from_summary's; None: the p99s decide
        self.workload = workload
        self.seed = seed
        self.window = window
        self.workload_kw = workload_kw or {}
        self.num_runs = 0
        self._devices: dict[tuple[str, str], SimDevice] = {}

    def run(self, config: SimConfig, rate: float, stop_at_slo_miss: bool = True) -> RunFigures:
        """One run; by default it ends as soon as its TTFT p99 is sure to miss the SLO
        (the search needs only that verdict; figures that must cover the whole run pass False).
        Judged by attainment, a run always finishes: a late p99 proves nothing there."""
        stop_at_slo_miss = stop_at_slo_miss and self.attainment is None
        requests = make_workload(self.workload, self.window.num_requests(rate), rate, self.seed, **self.workload_kw)
        key = (config.shape, config.profile)
        device = self._devices.get(key)
        if device is None:
            device = self._devices[key] = SimDevice.from_config(config)
        self.num_runs += 1
        t0 = time.perf_counter()
        with collector_paused():
            summary = simulate(replace(config, seed=self.seed, stop_at_slo_miss=stop_at_slo_miss), requests,
                               device).summary()
        fig = RunFigures.from_summary(rate, summary, config.slo_ttft_ms / 1000.0, config.slo_itl_ms / 1000.0,
                                      self.attainment)
        if self.log is not None:
            self.log(f"    {self.workload} x{config.num_replicas} {config.router}"
                     f"{f' ingress {config.num_ingress}' if config.num_ingress > 1 else ''} seed {self.seed} "
                     f"rate {rate:8.2f} ({len(requests)} req): {'meets' if fig.meets_slo else 'misses'} SLO"
                     f"{' (stopped at the miss)' if fig.stopped else ''}, TTFT p99 {fig.ttft_p99_s:7.3f} s, "
                     f"ITL p99 {1000 * fig.itl_p99_s:6.1f} ms, within {'-' if fig.stopped else f'{fig.within_share:.1%}'}, goodput {'-' if fig.stopped else f'{fig.goodput_rps:.2f}':>7}, "
                     f"hit {fig.hit_rate:.3f}, imbalance {fig.imbalance:.2f} "
                     f"({time.perf_counter() - t0:.1f} s)")
        return fig

    def goodput(self, config: SimConfig, start_rate: float, search: Search,
                known_miss: float | None = None) -> RunFigures:
        """goodput_at_slo over this runner's runs of `config`."""
        return goodput_at_slo(lambda rate: self.run(config, rate), start_rate, search, known_miss)


def goodput_at_slo(run: Callable[[float], RunFigures], start_rate: float, search: Search,
                   known_miss: float | None = None) -> RunFigures:
    """The best run that meets the SLO (a rate-0 placeholder if even the lowest tried fails).
    `known_miss`: a rate above `start_rate` seen to miss by another search. It is tried
    before the start: a router that meets it is better than the one that missed there,
    and its run at `start_rate` would only confirm a rate below its bracket (one
    simulation saved per winning router); a router that misses it then runs the start,
    exactly the two runs it took when the start came first. Either way every router
    visits the same rates as a start-first search would (if meeting the SLO is monotone
    in the rate, which the whole search assumes)."""
    probe = run(known_miss) if known_miss is not None and known_miss > start_rate else None
    if probe is not None and probe.meets_slo:
        lo, hi, rate, best, last_miss = known_miss, None, known_miss, probe, None
    else:
        first = run(start_rate)
        best = first if first.meets_slo else None
        lo, hi = (start_rate, None) if first.meets_slo else (None, start_rate)
        if probe is not None and first.meets_slo:
            hi = known_miss
        rate = start_rate
        # Not the probe: "a lower rate did not help" compares rates at or below the start.
        last_miss = None if first.meets_slo else first
    for _ in range(search.max_steps_out):
        if lo is not None and hi is not None:
            break
        rate = rate * search.step if hi is None else rate / search.step
        fig = run(rate)
        if fig.meets_slo:
            lo, best = rate, fig
        else:
            hi = rate
            if last_miss is not None and fig.shortfall >= (1.0 - NO_RELIEF) * last_miss.shortfall:
                break  # a lower rate did not help: the SLO is out of reach at any rate (e.g. one prefill > 2 s)
            last_miss = fig
    if hi is None:
        assert best is not None
        return replace(best, lower_bound=True)
    if lo is None:
        return RunFigures(0.0, False, 0.0, math.nan, math.nan, math.nan, 0.0, 0.0, 1.0, next_miss_rps=hi)
    for _ in range(search.bisect_steps):
        if hi / lo <= search.resolution * (1.0 + 1e-9):
            break
        mid = math.sqrt(lo * hi)
        fig = run(mid)
        if fig.meets_slo:
            lo, best = mid, fig
        else:
            hi = mid
    assert best is not None
    return replace(best, next_miss_rps=hi)
