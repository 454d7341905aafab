"""The routing benchmark's trace cells (benchmarks/routing/setup.py TRACE): the committed
Mooncake slice loads, its arrivals scale to a searched rate with their shape kept, a run is
judged by SLO attainment, and a small slice runs through the simulator with the real
headroom policy."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.routing.search import RunFigures, Runner, Search, Window, goodput_at_slo
from benchmarks.routing.setup import TRACE, TRACE_ATTAINMENT, TRACE_PATH, slo_attainment, sim_config, workload_kw
from cluster.workload.sim_kinds import MOONCAKE_BLOCK_TOKENS, make_workload


def test_the_committed_slice_and_its_notice_are_there() -> None:
    assert TRACE_PATH.is_file() and (TRACE_PATH.parent / "NOTICE.md").is_file()
    with TRACE_PATH.open(encoding="utf-8") as f:
        assert sum(1 for _ in f) == 3000


def test_arrivals_scale_to_the_rate_and_keep_their_shape() -> None:
    kw = workload_kw(TRACE, 4)
    recorded = make_workload(TRACE, 50, 0.0, 0, path=kw["path"])
    scaled = make_workload(TRACE, 50, 2.5, 0, **kw)
    # 49 gaps over the slice's span at 2.5 requests/s; every gap scaled by the same factor.
    assert scaled[-1].arrival_s == pytest.approx(49 / 2.5)
    k = scaled[-1].arrival_s / recorded[-1].arrival_s
    assert [r.arrival_s for r in scaled] == pytest.approx([k * r.arrival_s for r in recorded])
    # Same requests otherwise; the trace's first hash block (a shared system prompt) is shared.
    assert [r.prompt_token_ids for r in scaled] == [r.prompt_token_ids for r in recorded]
    head = scaled[0].prompt_token_ids[:MOONCAKE_BLOCK_TOKENS]
    assert all(r.prompt_token_ids[:MOONCAKE_BLOCK_TOKENS] == head for r in scaled)


def test_a_trace_run_is_judged_by_attainment_and_searched_on_its_shortfall() -> None:
    assert slo_attainment(TRACE) == TRACE_ATTAINMENT and slo_attainment("b2b") is None
    summary = {"ttft_s": {"p50": 0.4, "p99": 6.0}, "itl_s": {"p99": 0.09}, "num_finished": 10, "num_requests": 10,
               "goodput_rps": 2.0, "goodput_fraction": 0.92, "output_tokens_per_s": 1.0,
               "prefix_cache_hit_rate": 0.2, "load_imbalance": 1.0, "stopped_at_slo_miss": False}
    by_share = RunFigures.from_summary(3.0, summary, 2.0, 0.1, TRACE_ATTAINMENT)
    by_p99 = RunFigures.from_summary(3.0, summary, 2.0, 0.1)
    assert by_share.meets_slo and not by_p99.meets_slo
    assert by_share.shortfall == pytest.approx(0.08) and by_p99.shortfall == 6.0

    # A p99 that long prompts pin does not end a step down while the share still improves.
    def run(rate: float) -> RunFigures:
        return replace(by_share, rate_rps=rate, meets_slo=rate <= 1.0, within_share=min(1.0, 0.8 + 0.1 / rate))
    best = goodput_at_slo(run, 4.0, Search(bisect_steps=0, step=2.0))
    assert best.meets_slo and best.rate_rps == 1.0


def test_a_small_slice_runs_through_the_simulator() -> None:
    runner = Runner(TRACE, 0, Window(4.0, 24, 24), workload_kw(TRACE, 2), attainment=slo_attainment(TRACE))
    fig = runner.run(sim_config("headroom", 2), 6.0)
    assert fig.by_attainment and not fig.stopped
    assert 0.0 < fig.within_share <= 1.0 and fig.goodput_rps > 0.0 and fig.hit_rate > 0.0
    assert fig.meets_slo == (fig.within_share >= TRACE_ATTAINMENT)
