"""benchmarks/router.py's pure parts (no Ray): the sides alternate their order over the
repeats, figures are in modelled time with failed requests as missed TTFTs, and the RESULT
line gives the medians of the per-repeat ratios."""
from __future__ import annotations

import math
from types import SimpleNamespace

from benchmarks.router import (
    ROUTERS,
    BenchSpec,
    RunResult,
    result_line,
    run_order,
    score,
    spread,
)


def _run(router: str, ttft_s: list[float], good: int, duration_s: float) -> RunResult:
    return RunResult(router, 1.0, ttft_s=ttft_s, num_good=good, duration_s=duration_s)


def test_the_order_of_the_sides_alternates() -> None:
    assert run_order(0) == ROUTERS and run_order(1) == ROUTERS[::-1] and run_order(2) == ROUTERS


def test_spread_is_median_min_max_of_finite_values() -> None:
    assert spread([3.0, 1.0, 2.0, math.nan]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(x) for x in spread([math.nan]))


def test_result_line_gives_median_ratios_over_repeats() -> None:
    runs = [
        {"headroom": _run("headroom", [0.1], 10, 1.0), "pow2": _run("pow2", [0.2], 8, 1.0)},
        {"headroom": _run("headroom", [0.2], 10, 1.0), "pow2": _run("pow2", [0.2], 10, 1.0)},
        {"headroom": _run("headroom", [0.4], 9, 1.0), "pow2": _run("pow2", [0.2], 10, 1.0)},
    ]
    assert result_line(runs) == "RESULT ttft_p99_ratio=1.000 goodput_ratio=1.000 runs=3"
    assert result_line(runs[:1]) == "RESULT ttft_p99_ratio=2.000 goodput_ratio=1.250 runs=1"


def test_score_divides_real_times_by_the_dilation_and_applies_the_slo() -> None:
    spec = BenchSpec(time_dilation=10.0, slo_ttft_ms=2000.0, slo_itl_ms=100.0)

    def result(start: float, ttft: float, e2e: float, tokens: int, ok: bool = True, status: int = 200) -> SimpleNamespace:
        tpot = (e2e - ttft) / (tokens - 1) if ok else None
        return SimpleNamespace(success=ok, status=status, start_s=start, ttft_s=ttft if ok else None, e2e_s=e2e,
                               tpot_s=tpot, output_tokens=tokens, cached_tokens=16)

    results = [
        result(0.0, 10.0, 19.0, 10),  # TTFT 1 s, TPOT 0.1 s modelled: good
        result(1.0, 30.0, 39.0, 10),  # TTFT 3 s: over the SLO
        result(2.0, 0.0, 0.0, 0, ok=False, status=429),  # shed
    ]
    run = score("headroom", results, [r.start_s for r in results], spec)
    assert run.num_good == 1 and run.num_failed == 1 and run.num_shed == 1
    assert run.ttft_s == [1.0, 3.0, math.inf] and run.cached_tokens == 32
    assert run.duration_s == 4.0 and run.goodput_rps == 0.25  # (1 + 39 - 0) / 10 s modelled
