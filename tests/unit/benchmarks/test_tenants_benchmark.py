"""benchmarks/tenants.py's pure parts (no Ray): outcomes in modelled time, a shed request
counted as shed and not lost, Jain's index, and the RESULT line."""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

from benchmarks.tenants import KEYS, Outcome, jain, outcome, report


def result(success: bool, ttft_s: float | None = None, tpot_s: float = 0.0, status: int | None = 200) -> SimpleNamespace:
    return SimpleNamespace(success=success, ttft_s=ttft_s, tpot_s=tpot_s, status=status, start_s=0.0, e2e_s=1.0,
                           error=None if success else f"HTTP {status}", error_detail="")


def test_outcomes_are_modelled_and_sheds_are_not_lost() -> None:
    ok = outcome("premium-1", result(True, ttft_s=10.0, tpot_s=0.5), dilation=10.0)
    assert ok.finished and ok.ttft_s == 1.0 and ok.good  # 1 s TTFT, 50 ms TPOT modelled
    slow = outcome("premium-1", result(True, ttft_s=30.0), dilation=10.0)
    assert slow.finished and not slow.good
    shed = outcome("batch-flood", result(False, status=429), dilation=10.0)
    assert not shed.finished and math.isinf(shed.ttft_s)


def test_jain_index() -> None:
    assert jain([2.0, 2.0]) == 1.0 and jain([1.0, 0.0]) == 0.5 and math.isnan(jain([0.0, 0.0]))


def test_the_result_line() -> None:
    def o(key: str, ttft: float, status: int | None = 200) -> Outcome:
        finished = status == 200
        return Outcome(key, ttft if finished else math.inf, finished, status, finished, 10.0)

    alone = [o("premium-1", 0.1), o("premium-2", 0.2)]
    overload = [o("premium-1", 0.2), o("premium-2", 0.2), o("standard-1", 0.3), o("standard-2", 0.3),
                o("batch-flood", 0.0, 429), o("batch-flood", 0.0, 503), o("batch-1", 0.0, 500)]
    lines = report(alone, overload, dilation=1.0)
    # 4 requests within the SLO over the phase's 10 s; no output tokens counted.
    assert lines[-1] == "RESULT premium_ttft_p99_ratio=1.000 jain_index=1.000 lost=1 goodput_rps=0.40 tokens_per_s=0"
    # The baseline: the premium p99 doubled, half the goodput and the tokens.
    baseline = [replace(x, ttft_s=0.4 if x.key in ("premium-1", "premium-2") else x.ttft_s, output_tokens=5)
                for x in overload if x.key != "standard-2"]
    overload = [replace(x, output_tokens=5) for x in overload]
    assert report(alone, overload, 1.0, baseline)[-1] == (
        "RESULT premium_ttft_p99_ratio=1.000 jain_index=1.000 lost=1 goodput_rps=0.40 tokens_per_s=4 "
        "unlimited_premium_ttft_p99_ratio=2.000 goodput_vs_unlimited=1.333 tokens_vs_unlimited=1.167")
    assert set(KEYS) >= {"premium-1", "standard-1", "batch-flood"}


def test_trace_breakdown_splits_ttft_into_phases_per_band() -> None:
    from benchmarks.tenants import trace_breakdown

    def span(name: str, trace: str, start_ms: float, end_ms: float, **attributes: object) -> SimpleNamespace:
        return SimpleNamespace(name=name, trace_id=trace, start_ns=int(start_ms * 1e6), end_ns=int(end_ms * 1e6),
                               attributes=attributes)

    spans = [  # real ms at dilation 10: one premium request, held 100 ms, 1 preemption
        span("kvserve.request", "t1", 1000, 2000), span("kvserve.generate", "t1", 1100, 2000, **{"kvserve.priority": 0}),
        span("kvserve.replica", "t1", 1120, 2000, **{"kvserve.num_preemptions": 1}),
        span("kvserve.engine.queue", "t1", 1120, 1170), span("kvserve.engine.prefill", "t1", 1170, 1370),
        span("kvserve.request", "t2", 5000, 6000),  # outside the window: not counted
    ]
    lines = trace_breakdown(spans, int(500e6), int(3000e6), dilation=10.0)
    row = lines[1].split()
    assert row[:2] == ["0", "1"]
    assert [float(x) for x in row[2:12]] == [10.0, 10.0, 2.0, 2.0, 5.0, 5.0, 20.0, 20.0, 37.0, 37.0]
    assert row[12] == "1"
    assert lines[2] == "best band, slowest: hold=10.0 dispatch=2.0 queue=5.0 prefill=20.0 traced=37.0 preemptions=1"
