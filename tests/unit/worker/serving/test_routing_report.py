"""The routing-stats report's forecast figures (worker/serving/routing_report.py, worker/engine/step_meters.py):
decode growth, observed output lengths, the measured prefill rate; on the real engine over a
simulated device where an engine is needed."""
from __future__ import annotations

import pytest

from router.routing.types import ReplicaReport
from worker.api import ROUTING_STATS_KEYS, SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.serving.replica import WorkerReplica
from worker.serving.routing_report import (
    build_routing_stats,
    decode_growth_blocks,
    growth_blocks,
)
from worker.sequence import Sequence
from worker.sim.build import build_sim_engine
from worker.engine.step_meters import OutputLengthTracker, PrefillRateMeter

BS = 16


def seq(prompt_len: int, max_tokens: int, num_output: int = 0, computed: int | None = None) -> Sequence:
    """A sequence with `num_output` sampled tokens; by default every token but the last
    sampled one computed (a decode between steps)."""
    s = Sequence("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    for t in range(num_output):
        s.append_token(t)
    s.num_computed_tokens = s.num_tokens - 1 if computed is None else computed
    return s


# ---------------------------------------------------------------- the growth forecast


def test_growth_of_a_young_decode_is_the_mean_less_what_it_holds() -> None:
    # 40 prompt + 9 out, 48 computed: holds 3 blocks; forecast min(100, max(30, 10)) = 30
    # output -> 70 tokens = 5 blocks: 2 to grow.
    assert growth_blocks(seq(40, 100, num_output=9), 48, 30.0, BS, 4096) == 2


def test_a_sequence_past_the_mean_is_forecast_one_more_token() -> None:
    # 40 + 40 out, 79 computed (5 blocks): forecast max(30, 41) = 41 -> 81 tokens = 6 blocks.
    assert growth_blocks(seq(40, 100, num_output=40), 79, 30.0, BS, 4096) == 1
    # ...and one exactly at a block's end grows by nothing more: 40 + 24 = 64 tokens, 63
    # computed (4 blocks); max(30, 25) = 30 -> 70 tokens = 5 blocks: 1.
    assert growth_blocks(seq(40, 100, num_output=24), 63, 30.0, BS, 4096) == 1


def test_growth_is_capped_by_max_tokens_and_max_model_len() -> None:
    # max_tokens 20 < mean 30: 60 tokens = 4 blocks, 3 held.
    assert growth_blocks(seq(40, 20, num_output=1), 40, 30.0, BS, 4096) == 1
    # max_model_len 48: 70 tokens capped to 48 = 3 blocks, all held.
    assert growth_blocks(seq(40, 100, num_output=1), 40, 30.0, BS, 48) == 0


def test_nothing_observed_falls_back_to_256_and_counts_the_prompt_rest() -> None:
    # Mid chunked prefill: 32 of 40 prompt tokens computed (2 blocks held); forecast
    # min(1000, 256) -> 296 tokens = 19 blocks: 17 to grow, the prompt's last block included.
    assert growth_blocks(seq(40, 1000, computed=32), 32, 0.0, BS, 4096) == 17


def test_total_counts_running_growth_and_waiting_decode_only() -> None:
    running = [seq(40, 100, num_output=9), seq(40, 100, num_output=40)]  # 2 + 1
    waiting = [seq(40, 100, computed=0)]  # 70 tokens = 5 blocks, prompt's 3 are reserved: 2
    assert decode_growth_blocks(running, waiting, 30.0, BS, 4096) == 5


# ---------------------------------------------------------------- observed output lengths


def test_output_tracker_is_a_mean_over_the_last_window() -> None:
    t = OutputLengthTracker(window=3)
    assert (t.mean, t.count) == (0.0, 0)
    for n in (10, 20, 30):
        t.record(n)
    assert t.mean == 20.0
    t.record(40)  # 10 falls out
    assert (t.mean, t.count) == (30.0, 3)


def small_engine(**kw: object) -> Engine:
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=4096)
    return build_sim_engine("llama-3-8b", "h200", scheduler,
                            CacheConfig(block_size=BS, num_blocks_override=200), **kw)  # type: ignore[arg-type]


def run_to_end(engine: Engine) -> None:
    for _ in range(1000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_engine_records_normal_finishes_only() -> None:
    engine = small_engine()
    # A simulated device never samples EOS: each request runs to max_tokens ("length").
    engine.add_request("a", list(range(20)), SamplingParams(max_tokens=5))
    engine.add_request("b", list(range(30)), SamplingParams(max_tokens=9))
    engine.add_request("c", list(range(25)), SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("c")  # an abort says nothing about answer lengths
    run_to_end(engine)
    assert (engine.output_lengths.count, engine.output_lengths.mean) == (2, 7.0)


# ---------------------------------------------------------------- measured prefill rate


def test_prefill_meter_counts_budget_full_steps_in_device_seconds() -> None:
    m = PrefillRateMeter(token_budget=100, time_dilation=20.0, window=2, min_steps=2)
    m.record([100], 2.0)  # 100 prefill tokens in 2.0 / 20 = 0.1 device s
    assert m.tokens_per_s == 0.0  # not enough steps yet
    m.record([50], 1.0)  # not budget full: demand-limited, ignored
    m.record([1] * 100, 1.0)  # only decodes: ignored
    assert m.tokens_per_s == 0.0
    m.record([90] + [1] * 10, 4.0)  # 90 prefill tokens in 0.2 s
    assert m.tokens_per_s == pytest.approx(190 / 0.3)
    m.record([100], 6.0)  # the first step leaves the window: (90 + 100) / (0.2 + 0.3)
    assert m.tokens_per_s == pytest.approx(190 / 0.5)


def test_engine_measures_prefill_in_modelled_seconds() -> None:
    engine = small_engine()
    engine.add_request("long", list(range(1200)), SamplingParams(max_tokens=2))
    min_steps = engine.prefill_meter.min_steps
    tokens, seconds = 0, 0.0
    for _ in range(min_steps - 1):  # full 64-token prompt chunks
        engine.step()
        tokens, seconds = tokens + 64, seconds + engine.runner.last_step_s
    assert engine.prefill_meter.tokens_per_s == 0.0  # not measured yet: the router falls back
    engine.step()
    tokens, seconds = tokens + 64, seconds + engine.runner.last_step_s
    assert engine.prefill_meter.tokens_per_s == pytest.approx(tokens / seconds)


def test_a_sleeping_dilated_device_reports_device_time_not_wall_time() -> None:
    # Serve's simulated devices sleep dilation x the modelled step: the figure divides it out.
    engine = small_engine(sleep=True, time_dilation=3.0)
    engine.add_request("long", list(range(1200)), SamplingParams(max_tokens=2))
    steps = engine.prefill_meter.min_steps
    modelled = 0.0
    for _ in range(steps):
        engine.step()
        modelled += engine.runner.last_step_s
    # Wall time is ~3x the modelled time; the figure is the modelled rate, far from a third
    # of it. A sleep only ever runs long (and a loaded machine stretches it), so the bound
    # below the rate is loose and the one above it tight.
    rate, modelled_rate = engine.prefill_meter.tokens_per_s, steps * 64 / modelled
    assert 0.6 * modelled_rate < rate <= 1.05 * modelled_rate


# ---------------------------------------------------------------- the report


def test_report_carries_growth_mean_and_rate_and_the_router_parses_it() -> None:
    engine = small_engine()
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=100))
    engine.add_request("b", list(range(40)), SamplingParams(max_tokens=100))
    engine.step()  # both prefilled (80 tokens > 64: a's 40 and b's first 24)
    engine.step()
    # a: 40 + 2 out, 41 computed (3 blocks); b: 40 + 1, 40 computed (3 blocks). Nothing has
    # finished: forecast min(100, 256) = 100 -> 140 tokens = 9 blocks: 6 each.
    stats = build_routing_stats(engine, engine.stats(), [], timestamp=5.0, capacity_weight=0.5)
    assert (stats.decode_growth_blocks, stats.mean_output_tokens, stats.timestamp) == (12, 0.0, 5.0)
    assert stats.prefill_tokens_per_s == 0.0  # one full step is not enough to measure
    report = ReplicaReport.from_stats(stats.to_dict())
    assert report is not None
    assert (report.decode_growth_blocks, report.mean_output_tokens, report.capacity_weight) == (12, 0.0, 0.5)


def test_the_worker_replica_reports_through_the_same_builder() -> None:
    engine = small_engine()
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=100))
    engine.step()  # a: 40 + 1 out, 40 computed (3 blocks); forecast 100 -> 9 blocks: 6
    replica = WorkerReplica.__new__(WorkerReplica)
    replica._attach(AsyncEngine(engine), BS, drain_timeout_s=1.0)
    stats = replica.record_routing_stats()
    assert set(stats) == set(ROUTING_STATS_KEYS)
    assert (stats["decode_growth_blocks"], stats["mean_output_tokens"], stats["num_running"]) == (6, 0.0, 1)


def test_report_counts_the_prompt_a_running_sequence_has_left_to_prefill() -> None:
    # Chunks of 64 tokens: after one step the 1,200-token prompt is running with 1,136 to
    # go and nothing is waiting; the report says so, and the router reads it.
    engine = small_engine()
    engine.add_request("long", list(range(1200)), SamplingParams(max_tokens=2))
    engine.step()
    stats = build_routing_stats(engine, engine.stats(), [], timestamp=5.0)
    assert (stats.num_waiting, stats.num_waiting_prompt_tokens, stats.num_running_prompt_tokens) == (0, 0, 1136)
    report = ReplicaReport.from_stats(stats.to_dict())
    assert report is not None and report.num_running_prompt_tokens == 1136
    for _ in range(1136 // 64 + 1):
        engine.step()
    assert build_routing_stats(engine, engine.stats(), [], timestamp=6.0).num_running_prompt_tokens == 0
