"""benchmarks/router.py's pure parts (no Ray): the sides alternate their order over the
repeats, and the RESULT line gives the median and the spread of the per-repeat ratios."""
from __future__ import annotations

import math

from benchmarks.router import ROUTERS, BenchSpec, RunResult, make_bench_workload, result_line, run_order, spread


def _run(router: str, ttft_s: list[float], tokens: int, wall_s: float, preemptions: int = 0) -> RunResult:
    return RunResult(router, ttft_s=ttft_s, num_output_tokens=tokens, wall_s=wall_s, num_preemptions=preemptions)


def test_the_order_of_the_sides_alternates() -> None:
    assert run_order(0) == ROUTERS and run_order(1) == ROUTERS[::-1] and run_order(2) == ROUTERS
    assert sorted(run_order(1)) == sorted(ROUTERS)


def test_spread_is_median_min_max_of_finite_values() -> None:
    assert spread([3.0, 1.0, 2.0, math.nan]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(x) for x in spread([math.nan]))


def test_result_line_reports_median_and_spread_over_repeats() -> None:
    runs = [
        {"kv_headroom": _run("kv_headroom", [0.1], 100, 10.0, 1), "pow2": _run("pow2", [0.2], 100, 10.0, 3)},
        {"kv_headroom": _run("kv_headroom", [0.2], 110, 10.0, 0), "pow2": _run("pow2", [0.2], 100, 10.0, 2)},
        {"kv_headroom": _run("kv_headroom", [0.4], 90, 10.0, 2), "pow2": _run("pow2", [0.2], 100, 10.0, 5)},
    ]
    assert result_line(runs) == (
        "RESULT ttft_p99_ratio=1.000 ttft_p99_ratio_min=0.500 ttft_p99_ratio_max=2.000 "
        "throughput_ratio=1.000 throughput_ratio_min=0.900 throughput_ratio_max=1.100 "
        "preemptions_headroom=1 preemptions_default=3 repeats=3"
    )


def test_workload_is_seeded_and_shares_prefixes() -> None:
    spec = BenchSpec(num_requests=20, num_prefixes=2, prefix_len=8)
    a = make_bench_workload(spec, 512, frozenset({0, 1, 2}))
    assert a == make_bench_workload(spec, 512, frozenset({0, 1, 2}))
    assert len({tuple(t.request.prompt_token_ids[:8]) for t in a}) <= 2
    assert [t.arrival_s for t in a] == sorted(t.arrival_s for t in a)
