"""The metrics of `python -m benchmarks.disagg` (no Ray, no HTTP: unit-testable); its
workload is cluster/workload/disagg.py.

What disaggregation is meant to protect is the decode streams' inter-token latency while
prompts are being prefilled, so ITL is taken over the decode streams' gaps that END inside
the interference window (from the first long prompt sent to the last one answered); the
long prompts' own number is their time to first token.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.bench.stream import RequestResult


def token_times(result: RequestResult) -> list[float]:
    """Arrival times (from the round's start) of a result's content chunks."""
    if result.ttft_s is None:
        return []
    t = result.start_s + result.ttft_s
    times = [t]
    for gap in result.itl_s:
        t += gap
        times.append(t)
    return times


def gaps_in_window(results: Sequence[RequestResult], start_s: float, end_s: float) -> list[float]:
    """Inter-token gaps of successful results whose later chunk arrived in [start_s, end_s]."""
    gaps = []
    for r in results:
        if not r.success:
            continue
        times = token_times(r)
        gaps += [gap for gap, t in zip(r.itl_s, times[1:]) if start_s <= t <= end_s]
    return gaps


def interference_window(long_results: Sequence[RequestResult]) -> tuple[float, float] | None:
    """From the first long prompt sent to the last one answered (None: none answered)."""
    done = [r for r in long_results if r.success and r.e2e_s is not None]
    if not done:
        return None
    return min(r.start_s for r in long_results), max(r.start_s + (r.e2e_s or 0.0) for r in done)


def ratio(mixed: float, disagg: float) -> float:
    """mixed / disagg: > 1 means the disaggregated pools did better on a latency."""
    if not (math.isfinite(mixed) and math.isfinite(disagg)) or disagg <= 0:
        return math.nan
    return mixed / disagg
