"""The workloads and fleets of `python -m benchmarks.planner` (benchmarks/planner.py).

    bursty      Poisson arrivals alternating between a low and a high rate every phase_s
                (dynamo#10528: 1 <-> 24 req/s), long prompts and answers, disaggregated pools
    day         three models whose popularity shifts over a day of 24 "hours" of hour_s
                each (a compressed day: replica start-up stays real), one of them idle for
                most of it; each model its own mixed pool
Every prompt starts with its own random block, so no two share a prefix (the prefix cache
does not hide prefill work). GPU time counts each replica from its creation (a starting
replica holds its device) to its removal or the run's end.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster.sim.metrics import SimResult
from cluster.workload.sim_kinds import SimRequest

VOCAB = 250  # small token ids: Python keeps one object per id, so long prompts stay cheap in memory


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate_rps: float


def phased_requests(phases: Sequence[Phase], prompt_tokens: int, output_tokens: int, seed: int,
                    prefix: str = "r") -> list[SimRequest]:
    """Poisson arrivals at each phase's rate, one phase after another."""
    rng = np.random.default_rng(seed)
    requests: list[SimRequest] = []
    start = 0.0
    for phase in phases:
        t = start
        while phase.rate_rps > 0:
            t += float(rng.exponential(1.0 / phase.rate_rps))
            if t >= start + phase.duration_s:
                break
            prompt = tuple(rng.integers(1, VOCAB, size=prompt_tokens).tolist())
            requests.append(SimRequest(f"{prefix}{len(requests)}", t, prompt, output_tokens))
        start += phase.duration_s
    return requests


def bursty_phases(low_rps: float, high_rps: float, phase_s: float, cycles: int) -> list[Phase]:
    """low, high, low, high, ... (`cycles` of each), starting low."""
    return [Phase(phase_s, rate) for _ in range(cycles) for rate in (low_rps, high_rps)]


# Requests/s per "hour" of the day, per model: a daytime model, an evening model, and a
# night-batch model idle from 05:00 to 20:00.
DAY_RATES: dict[str, tuple[float, ...]] = {
    "day": tuple(0.3 if h < 7 or h >= 19 else (1.5 if h in (7, 18) else 3.0) for h in range(24)),
    "evening": tuple(2.0 if 17 <= h <= 22 else 0.2 for h in range(24)),
    "night": tuple(1.0 if h < 5 or h >= 20 else 0.0 for h in range(24)),
}


def day_requests(model: str, hour_s: float, prompt_tokens: int, output_tokens: int, seed: int) -> list[SimRequest]:
    return phased_requests([Phase(hour_s, r) for r in DAY_RATES[model]], prompt_tokens, output_tokens, seed,
                           prefix=f"{model}-")


def oracle_gpu_seconds(phases: Sequence[Phase], high_rps: float, low_pools: Sequence[int],
                       high_pools: Sequence[int], tails_s: Sequence[float], startup_s: float, end_s: float) -> float:
    """GPU seconds of a fleet that knows the trace in advance, a lower bound for any planner
    that meets every burst: pool i runs `high_pools[i]` replicas from a start-up before each
    phase at `high_rps` until `tails_s[i]` after it ends (its last work done), and
    `low_pools[i]` otherwise, up to `end_s` (on a 1 s grid)."""
    grid = np.arange(0.0, end_s, 1.0)
    total = 0.0
    for low, high, tail in zip(low_pools, high_pools, tails_s):
        peak = np.zeros(len(grid), dtype=bool)
        start = 0.0
        for phase in phases:
            if phase.rate_rps >= high_rps:
                peak |= (grid >= start - startup_s) & (grid < start + phase.duration_s + tail)
            start += phase.duration_s
        total += float(np.where(peak, high, low).sum())
    return total


def gpu_seconds(result: SimResult) -> float:
    end = max((r.finish_s for r in result.records if r.finish_s is not None), default=0.0)
    total = 0.0
    for replica in result.replicas:
        stop = end if replica.removed_at is None else min(replica.removed_at, end)
        total += max(stop - replica.created_at, 0.0)
    return total


def attainment(result: SimResult, ttft_s: float, itl_s: float, start_s: float = 0.0,
               end_s: float = float("inf")) -> float:
    """The share of requests arriving in [start_s, end_s) that finished with TTFT <= ttft_s
    and a mean ITL <= itl_s (rejected and unfinished ones count as missed)."""
    good = total = 0
    for r in result.records:
        if not start_s <= r.arrival_s < end_s:
            continue
        total += 1
        if r.first_token_s is None or r.finish_s is None:
            continue
        tpot = (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else 0.0
        good += (r.first_token_s - r.arrival_s) <= ttft_s and tpot <= itl_s
    return good / total if total else 0.0
