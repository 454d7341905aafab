"""benchmarks/disagg.py's pure parts without Ray: the workload's shape (seeded, periodic
long prompts after the ramp, decode-heavy streams), the interference window and the ITL
gaps inside it, the ratios of the RESULT line, and the two apps' configs."""
from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.disagg import (
    DISAGG,
    SideResult,
    best_mixed_budget,
    make_spec,
    parse_args,
    result_line,
    side_configs,
    side_order,
    sides,
)
from benchmarks.disagg_metrics import gaps_in_window, interference_window, ratio, token_times
from cluster.workload.disagg import QUICK, DisaggSpec, decode_stream_requests, long_arrivals, long_requests, round_seed
from cluster.bench.stream import RequestResult

SPEC = DisaggSpec(num_long_prompts=5, long_period_s=2.0, ramp_s=3.0, long_jitter=0.25)


def _stream(start: float, ttft: float, gaps: list[float], success: bool = True, index: int = 0) -> RequestResult:
    return RequestResult(index=index, success=success, start_s=start, ttft_s=ttft, itl_s=gaps,
                         e2e_s=ttft + sum(gaps), output_tokens=len(gaps) + 1)


# -- workload ------------------------------------------------------------------------------------
def test_long_arrivals_are_periodic_after_the_ramp_and_seeded() -> None:
    times = long_arrivals(SPEC, seed=7)
    assert times == long_arrivals(SPEC, seed=7)
    assert times != long_arrivals(SPEC, seed=8)
    assert len(times) == 5 and times == sorted(times)
    assert times[0] >= SPEC.ramp_s
    jitter = SPEC.long_jitter * SPEC.long_period_s
    for i, t in enumerate(times):
        assert abs(t - (SPEC.ramp_s + i * SPEC.long_period_s)) <= jitter


def test_long_jitter_must_keep_arrivals_in_order() -> None:
    with pytest.raises(ValueError):
        long_arrivals(DisaggSpec(long_jitter=0.5), seed=0)


def test_long_requests_are_long_prompts_with_short_outputs() -> None:
    requests = long_requests(SPEC, seed=3)
    assert [r.prompt_len for r in requests] == [SPEC.long_prompt_len] * 5
    assert [r.max_tokens for r in requests] == [SPEC.long_output_len] * 5
    assert len({r.prompt for r in requests}) == 5
    # A new round draws new prompts (no prefix-cache hit from the last round on the same app).
    assert not {r.prompt for r in requests} & {r.prompt for r in long_requests(SPEC, seed=4)}


def test_decode_streams_are_short_prompts_with_long_outputs_seeded_per_slot() -> None:
    first = list(itertools.islice(decode_stream_requests(SPEC, 0, slot=2), 50))
    again = list(itertools.islice(decode_stream_requests(SPEC, 0, slot=2), 50))
    other = list(itertools.islice(decode_stream_requests(SPEC, 0, slot=3), 50))
    assert first == again and first != other
    low, high = 1 - SPEC.range_ratio, 1 + SPEC.range_ratio
    for r in first:
        assert SPEC.decode_prompt_len * low - 1 <= r.prompt_len <= SPEC.decode_prompt_len * high + 1
        assert SPEC.decode_output_len * low - 1 <= r.max_tokens <= SPEC.decode_output_len * high + 1
    assert max(r.prompt_len for r in first) < SPEC.long_prompt_len
    assert len({r.index for r in first + other}) == 100


def test_rounds_draw_new_seeds_and_rotate_the_order_of_the_sides() -> None:
    assert len({round_seed(SPEC, r) for r in range(4)}) == 4
    all_sides = sides(SPEC)
    assert all_sides == ("mixed256", "mixed512", "mixed2048", DISAGG)
    orders = [side_order(r, all_sides) for r in range(len(all_sides))]
    assert orders[0] == all_sides and all(sorted(o) == sorted(all_sides) for o in orders)
    for position in range(len(all_sides)):  # each side takes every position once
        assert {o[position] for o in orders} == set(all_sides)
    assert side_order(len(all_sides), all_sides) == all_sides


def test_mixed_budgets_come_from_the_command_line_and_must_be_distinct() -> None:
    spec, _ = parse_args(["--mixed-budgets", "128,2048", "--quick"])
    assert spec.mixed_budgets == (128, 2048) and sides(spec) == ("mixed128", "mixed2048", DISAGG)
    with pytest.raises(ValueError):
        sides(DisaggSpec(mixed_budgets=(512, 512)))


def test_quick_then_flags_override_the_defaults() -> None:
    spec = make_spec({"num_decode_streams": 5, "seed": None}, quick=True)
    assert spec.num_decode_streams == 5
    assert spec.num_long_prompts == QUICK["num_long_prompts"]
    assert spec.seed == DisaggSpec().seed
    assert make_spec({}, quick=False) == DisaggSpec()


# -- metrics -------------------------------------------------------------------------------------
def test_token_times_add_up_the_gaps() -> None:
    assert token_times(_stream(1.0, 0.5, [0.25, 0.25, 1.0])) == [1.5, 1.75, 2.0, 3.0]
    assert token_times(RequestResult(index=0)) == []


def test_gaps_in_window_keep_the_gaps_that_end_inside_it() -> None:
    streams = [
        _stream(0.0, 0.5, [0.25, 0.25, 1.0, 0.25]),  # chunks at 0.5, 0.75, 1.0, 2.0, 2.25
        _stream(1.5, 0.25, [0.5]),  # chunks at 1.75, 2.25
        _stream(0.0, 0.5, [1.5], success=False),  # a failed stream counts nothing
    ]
    assert gaps_in_window(streams, 1.0, 2.0) == [0.25, 1.0]
    assert sorted(gaps_in_window(streams, 0.0, 10.0)) == [0.25, 0.25, 0.25, 0.5, 1.0]


def test_interference_window_spans_the_long_prompts() -> None:
    longs = [_stream(3.0, 0.5, [0.25]), _stream(5.0, 1.0, [0.25] * 2), _stream(4.0, 0.5, [], success=False)]
    assert interference_window(longs) == (3.0, 6.5)
    assert interference_window([_stream(3.0, 0.5, [], success=False)]) is None


def test_ratio_is_mixed_over_disagg_and_nan_when_undefined() -> None:
    assert ratio(30.0, 10.0) == 3.0
    assert math.isnan(ratio(30.0, 0.0))
    assert math.isnan(ratio(math.nan, 10.0))


def test_result_line_compares_with_the_best_mixed_budget_and_lists_every_budget() -> None:
    spec = DisaggSpec(mixed_budgets=(256, 2048))
    disagg = SideResult(DISAGG, long=[_stream(0.0, 0.25, [])], itl_window_s=[0.125, 0.25])
    small = SideResult("mixed256", long=[_stream(0.0, 1.0, [])], itl_window_s=[0.125, 0.25])  # chunked: low ITL
    large = SideResult("mixed2048", long=[_stream(0.0, 0.75, [])], itl_window_s=[0.125, 0.5])
    results = {"mixed256": small, "mixed2048": large, DISAGG: disagg}
    assert best_mixed_budget(spec, results) == 256
    itl = 0.125 + (0.5 - 0.125) * 0.99  # numpy-style p99 of two values
    itl_disagg = 0.125 + (0.25 - 0.125) * 0.99
    assert result_line(spec, results) == (
        "RESULT itl_p99_ratio=1.000 ttft_p99_ratio=4.000 best_mixed_budget=256 "
        f"itl_p99_ratio_256=1.000 ttft_p99_ratio_256=4.000 itl_p99_ratio_2048={itl / itl_disagg:.3f} "
        "ttft_p99_ratio_2048=3.000"
    )
    empty = {"mixed256": SideResult("mixed256"), "mixed2048": SideResult("mixed2048"), DISAGG: disagg}
    assert result_line(spec, empty).startswith("RESULT itl_p99_ratio=nan ttft_p99_ratio=nan best_mixed_budget=None ")


def test_side_result_counts_errors_and_decode_throughput() -> None:
    side = SideResult("mixed", decode=[_stream(0.0, 0.5, [0.25] * 3), _stream(0.0, 0.5, [], success=False)],
                      long=[RequestResult(index=1, error="HTTP 500")], duration_s=2.0)
    assert side.errors == 2
    assert side.decode_tokens_per_s == 2.0  # 4 tokens of the successful stream in 2 s
    assert side.itl_all_s == [0.25] * 3


# -- configs -------------------------------------------------------------------------------------
def test_every_side_gets_the_same_engine_but_its_budget_and_as_many_worker_replicas() -> None:
    from cluster.config import KVServeConfig

    configs = {side: KVServeConfig.from_dict(data) for side, data in side_configs(SPEC).items()}
    assert tuple(configs) == sides(SPEC)
    disagg = configs[DISAGG]
    assert disagg.engine.max_num_batched_tokens == SPEC.max_num_batched_tokens
    assert disagg.disaggregation is not None
    pools = disagg.disaggregation
    for budget in SPEC.mixed_budgets:
        mixed = configs[f"mixed{budget}"]
        assert mixed.engine.max_num_batched_tokens == budget
        assert mixed.engine.model_copy(update={"max_num_batched_tokens": 0}) == \
            disagg.engine.model_copy(update={"max_num_batched_tokens": 0})
        assert mixed.model == disagg.model and mixed.disaggregation is None
        assert mixed.workers.num_replicas == pools.prefill.num_replicas + pools.decode.num_replicas == 2
        assert mixed.workers.num_cpus == pools.prefill.num_cpus == pools.decode.num_cpus
    assert len({c.route_prefix for c in configs.values()}) == len({c.app_name for c in configs.values()}) == len(configs)
