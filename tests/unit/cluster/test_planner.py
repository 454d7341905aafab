"""The SLO planner's forecast, queueing and sizing against hand-computed cases, and the
GPU budget's sharing rule (cluster/planner/)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.planner.budget import PoolDemand, share_budget
from cluster.planner.forecast import Arrivals, Forecaster, Load
from cluster.planner.planner import PoolBounds, PoolObservation, PoolPlanner, decode_arrivals
from cluster.planner.queueing import erlang_c, servers_for_wait, wait_percentile_s
from cluster.planner.sizing import EngineLimits, PoolSizer
from cluster.planner.targets import PlannerSettings, SLOTargets
from worker.costs.cost_model import StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

SETTINGS = PlannerSettings(startup_s=60.0, interval_s=10.0, headroom=1.0, level_alpha=0.5, trend_beta=0.3)


class LinearCost:
    """A step-cost model simple enough to size by hand: 10 ms a step, 1 ms per decode row,
    0.1 ms per prompt token."""

    def predict_rows(self, rows: list[tuple[int, int, bool]]) -> float:
        return 0.01 + sum(0.001 if n == 1 else 0.0001 * n for n, _, _ in rows)


def sizer(kv_tokens: int = 1_000_000, ttft_s: float = 1.0, itl_s: float = 0.05) -> PoolSizer:
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=1000, kv_tokens=kv_tokens)
    return PoolSizer(LinearCost(), limits, SLOTargets(ttft_s=ttft_s, itl_s=itl_s), SETTINGS)  # type: ignore[arg-type]


# -- queueing --------------------------------------------------------------------------------
def test_erlang_c_two_servers_one_erlang() -> None:
    # (1^2/2!)(2/(2-1)) = 1 over 1 + 1 + 1: a third of the arrivals wait.
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # p90 wait: ln((1/3) / 0.1) / (2/1 - 1)
    assert wait_percentile_s(2, 1.0, 1.0, 90) == pytest.approx(math.log(10 / 3))
    assert erlang_c(1, 1.0) == 1.0 and wait_percentile_s(1, 1.0, 1.0, 90) == math.inf


def test_servers_for_wait_takes_the_fewest_within_the_bound() -> None:
    # c = 3, a = 1: (1/6)(3/2) = 0.25 over 1 + 1 + 0.5 + 0.25 -> 1/11 < 0.1: no p90 wait.
    assert erlang_c(3, 1.0) == pytest.approx(1 / 11)
    assert servers_for_wait(1.0, 1.0, 90, 0.5) == 3
    assert servers_for_wait(1.0, 1.0, 90, 2.0) == 2
    assert servers_for_wait(0.0, 1.0, 90, 0.5) == 0


# -- forecast --------------------------------------------------------------------------------
def test_holt_level_and_trend_by_hand() -> None:
    f = Forecaster(SETTINGS)
    f.observe(Arrivals(10.0, num_requests=10, prompt_tokens=10 * 800, output_tokens=2000))
    assert (f.level, f.trend) == (1.0, 0.0)
    f.observe(Arrivals(10.0, num_requests=30, prompt_tokens=30 * 1200, output_tokens=6000))
    # level = 0.5 * 3 + 0.5 * (1 + 0 * 10) = 2; trend = 0.3 * (2 - 1) / 10 = 0.03
    assert f.level == pytest.approx(2.0) and f.trend == pytest.approx(0.03)
    # the peak before a replica started now is ready (60 + 10 s): 2 + 0.03 * 70
    assert f.peak(SETTINGS.horizon_s).rate == pytest.approx(4.1)
    # the mix over the window: (8000 + 36000) / 40 prompt tokens, (2000 + 6000) / 40 output
    assert f.now().prompt_tokens == pytest.approx(1100.0)
    assert f.now().output_tokens == pytest.approx(200.0)


def test_a_falling_rate_plans_for_the_level_now() -> None:
    f = Forecaster(SETTINGS)
    for n in (100, 10):
        f.observe(Arrivals(10.0, num_requests=n))
    assert f.trend < 0
    assert f.peak(70.0).rate == pytest.approx(f.level)


def test_a_recurring_burst_is_forecast_one_period_later() -> None:
    f = Forecaster(SETTINGS)
    # 6 ticks at 1 req/s, 6 at 24 req/s, repeated: a period of 12 ticks (120 s).
    rates = [24.0 if (i // 6) % 2 else 1.0 for i in range(30)]
    for r in rates:
        f.observe(Arrivals(10.0, num_requests=r * 10))
    assert f.period_ticks() == 12
    # Ticks 24..29 were low; one period ago, the next 7 ticks (18..25) were high: the burst
    # is forecast although the level is low.
    assert f.level < 2.0
    assert f.peak(SETTINGS.horizon_s).rate == pytest.approx(24.0)
    # inside a recurring burst the season, not the step's trend, bounds the forecast
    for r in (24.0, 24.0):
        f.observe(Arrivals(10.0, num_requests=r * 10))
    assert f.trend > 0 and f.level + f.trend * SETTINGS.horizon_s > 24.0
    assert f.peak(SETTINGS.horizon_s).rate == pytest.approx(24.0)


def test_a_recurring_burst_counts_from_the_tick_it_reaches_the_horizon() -> None:
    # 9 ticks low, 9 high, repeated (period 18); ticks 0..37 seen, 36 and 37 low again. One
    # period ago, ticks 27.. were high: the burst is due at tick 45, 7 ticks from now --
    # exactly the horizon (60 + 10 s) -- and is forecast already.
    rates = [24.0 if (i // 9) % 2 else 1.0 for i in range(38)]
    f = Forecaster(SETTINGS)
    for r in rates:
        f.observe(Arrivals(10.0, num_requests=r * 10))
    assert f.period_ticks() == 18
    assert f.seasonal_peak(SETTINGS.horizon_s) == pytest.approx(24.0)
    # one tick earlier the burst was beyond the horizon: not yet
    g = Forecaster(SETTINGS)
    for r in rates[:-1]:
        g.observe(Arrivals(10.0, num_requests=r * 10))
    assert g.seasonal_peak(SETTINGS.horizon_s) == pytest.approx(1.0)


def test_a_burst_seen_once_is_not_a_season_and_its_trend_counts() -> None:
    # 5 ticks low, 5 high, 5 low, 1 high: lag 10 matches its 6 pairs exactly, but 6 pairs are
    # not a whole period; lags 8 (the horizon's 7 ticks + 1) and up to half the history
    # (8) do not correlate: not recurring, so the rise is met by its trend.
    rates = [1.0] * 5 + [24.0] * 5 + [1.0] * 5 + [24.0]
    f = Forecaster(SETTINGS)
    for r in rates:
        f.observe(Arrivals(10.0, num_requests=r * 10))
    assert f.period_ticks() is None
    assert f.trend > 0
    assert f.peak(SETTINGS.horizon_s).rate == pytest.approx(f.level + f.trend * SETTINGS.horizon_s)


def test_a_step_that_lines_up_with_one_noisy_tick_is_not_a_season() -> None:
    # 19 quiet ticks with one blip (tick 10), then a step (tick 19). At lag 9 the step lines
    # up with the blip: x[9:] = 1, 3, 1 x 8, 24 against x[:11] = 1 x 10, 3, a correlation of
    # 0.996, but the earlier copy varies by a tenth of the later one (std 0.57 against 6.58):
    # nothing recurred, and the step is met by its trend.
    rates = [1.0] * 10 + [3.0] + [1.0] * 8 + [24.0]
    a, b = np.asarray(rates[9:]), np.asarray(rates[:11])
    assert np.corrcoef(a, b)[0, 1] > 0.99 and b.std() / a.std() < 0.1
    f = Forecaster(SETTINGS)
    for r in rates:
        f.observe(Arrivals(10.0, num_requests=r * 10))
    assert f.period_ticks() is None
    assert f.trend > 0
    assert f.peak(SETTINGS.horizon_s).rate == pytest.approx(f.level + f.trend * SETTINGS.horizon_s)


def test_output_tokens_are_per_request_that_started_answering() -> None:
    # A decode pool: 10 requests a tick answered at 200 tokens each, then the model's arrivals
    # step to 50 a tick while prefill lets only 10 a tick through to decode.
    prefill = [Arrivals(10.0, n, n * 1000) for n in (10, 10, 50, 50)]
    decode = [Arrivals(10.0, 10, 10 * 1000, 2000) for _ in range(4)]
    f = Forecaster(SETTINGS, prompt_tokens=500, output_tokens=100)
    for p, d in zip(prefill, decode):
        f.observe(decode_arrivals(p, d))
    assert f.output_tokens == pytest.approx(8000 / 40)  # over the 40 that reached decode
    assert f.prompt_tokens == pytest.approx(1000.0)
    assert f.level > 2.0  # the rate is the model's (prefill's) arrivals: 1, 1, 5, 5 req/s
    # over the model's 120 arrivals the same answers would read as 8000 / 120 tokens
    g = Forecaster(SETTINGS, prompt_tokens=500, output_tokens=100)
    for p, d in zip(prefill, decode):
        g.observe(Arrivals(10.0, p.num_requests, p.prompt_tokens, d.output_tokens))
    assert g.output_tokens == pytest.approx(8000 / 120)


def test_a_steady_rate_is_not_recurring() -> None:
    f = Forecaster(SETTINGS)
    for _ in range(40):
        f.observe(Arrivals(10.0, num_requests=50))
    assert f.period_ticks() is None
    assert f.peak(70.0).rate == pytest.approx(5.0)


# -- sizing ----------------------------------------------------------------------------------
def test_decode_batch_and_replicas_by_hand() -> None:
    s = sizer()
    load = Load(rate=10.0, prompt_tokens=100, output_tokens=100)
    # 0.01 + 0.001 B <= 0.05 -> B = 40; 40 tokens / 0.05 s = 800 tokens/s per replica
    assert s.decode_batch(load) == 40
    # 10 req/s x 100 tokens = 1000 tokens/s -> ceil(1.25)
    assert s.decode_replicas(load) == 2
    # KV: 5000 x 0.9 / (100 + 100) = 22 sequences, below the ITL's 40
    assert sizer(kv_tokens=5000).decode_batch(load) == 22
    assert s.decode_replicas(load.scaled(0.0)) == 0
    # 90 decodes running now need ceil(90 / 40) replicas, whatever the rate forecast says
    assert s.decode_replicas(load, running=90) == 3


def test_prefill_service_and_replicas_by_hand() -> None:
    s = sizer()
    # 2500 tokens in chunks of 1000, 1000, 500: (0.01 + 0.1) * 2 + 0.01 + 0.05
    assert s.prefill_service_s(2500) == pytest.approx(0.28)
    load = Load(rate=10.0, prompt_tokens=2500, output_tokens=100)
    # a = 2.8 Erlangs. c = 3: C = 0.877, p90 wait 3.04 s; c = 4: C = (2.8^4/4!)(4/1.2) /
    # (1 + 2.8 + 3.92 + 3.6587 + 8.5369) = 0.4287, wait ln(4.287) / (4/0.28 - 10) = 0.34 s,
    # within 1 - 0.28.
    assert wait_percentile_s(4, 10.0, 0.28, 90) == pytest.approx(0.3396, abs=1e-4)
    assert s.prefill_replicas(load) == 4
    # A backlog of 5 requests drains within the TTFT target: 5 req/s more; within a longer
    # drain time (the start-up horizon) 0.5 req/s more.
    assert s.prefill_replicas(load, backlog=5.0) == servers_for_wait(15.0, 0.28, 90, 0.72)
    assert s.prefill_replicas(load, backlog=5.0, drain_s=10.0) == servers_for_wait(10.5, 0.28, 90, 0.72)


def test_mixed_replicas_cover_both_limits() -> None:
    s = sizer()
    load = Load(rate=10.0, prompt_tokens=100, output_tokens=100)
    x = s.mixed_rate(load)
    t, batch, chunk = s.mixed_step_s(x, load)
    assert t <= 0.05 + 1e-6 and batch <= 64
    assert s.mixed_replicas(load) >= math.ceil(10.0 / x - 1e-9)


def test_decode_batch_on_the_real_cost_model_is_the_last_within_the_target() -> None:
    cost = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    limits = EngineLimits(256, 8192, cost.num_kv_blocks(16) * 16)
    s = PoolSizer(cost, limits, SLOTargets(ttft_s=3.0, itl_s=0.035), PlannerSettings(headroom=0.85))
    load = Load(rate=24.0, prompt_tokens=8192, output_tokens=1024)
    batch = s.decode_batch(load)
    context = int(8192 + 512)
    assert s.decode_step_s(batch, context) <= 0.035 * 0.85 < s.decode_step_s(batch + 1, context)


# -- budget and the pool's decision ------------------------------------------------------------
def test_budget_by_priority_then_by_fraction() -> None:
    demands = [PoolDemand("a", "prefill", 4, 1, priority=1), PoolDemand("a", "decode", 8, 1, priority=1),
               PoolDemand("b", "mixed", 6, 1, priority=0)]
    assert share_budget(demands, None) == {("a", "prefill"): 4, ("a", "decode"): 8, ("b", "mixed"): 6}
    # 13 GPUs: minimums 3; model a's extra 10 fits exactly; b keeps its minimum.
    assert share_budget(demands, 13) == {("a", "prefill"): 4, ("a", "decode"): 8, ("b", "mixed"): 1}
    # 9 GPUs: a gets 6 beyond its minimums, one at a time to the lower granted/wanted
    # fraction (ties: prefill, listed first): decode 2/8, prefill 2/4, decode 3/8, decode
    # 4/8, prefill 3/4, decode 5/8 -> 3 + 5, near the 1:2 it asked for.
    assert share_budget(demands, 9) == {("a", "prefill"): 3, ("a", "decode"): 5, ("b", "mixed"): 1}


def test_pool_planner_sizes_ahead_and_scales_to_zero_when_idle() -> None:
    planner = PoolPlanner("m", "decode", sizer(), Forecaster(SETTINGS, 100, 100),
                          PoolBounds(min_replicas=0, max_replicas=8, scale_to_zero=True))
    busy = PoolObservation(Arrivals(10.0, num_requests=100, prompt_tokens=10_000, output_tokens=10_000))
    planner.observe(busy)
    assert planner.wanted(busy) == 2  # 10 req/s x 100 tokens at 800 tokens/s per replica
    idle = PoolObservation(Arrivals(10.0))
    for _ in range(20):
        planner.observe(idle)
    assert planner.wanted(idle) == 0
    assert planner.wanted(PoolObservation(Arrivals(10.0), backlog=1.0)) == 1  # a held request needs a replica
