"""Worse bands' prompt tokens per step while a better band is in use (worker/scheduling/band_prefill.py),
through the real Scheduler on a real KVCacheManager: which tokens go into a step."""
from __future__ import annotations

import pytest

from kv.cache_manager import KVCacheManager
from tests.support.scheduler_helpers import all_free, make_seq, rids, step
from worker.config import SchedulerConfig
from worker.scheduling.scheduler import Scheduler

LIMIT = 8


def make(limit: int = LIMIT, budget: int = 32) -> tuple[Scheduler, list[float]]:
    """A scheduler whose band limit reads the returned one-element clock."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128,
                             worse_band_prefill_tokens=limit)
    sched = Scheduler(config, KVCacheManager(64, 4, True))
    now = [0.0]
    if sched.band_limit is not None:
        sched.band_limit.clock = lambda: now[0]
    return sched, now


def test_single_band_traffic_keeps_the_whole_token_budget() -> None:
    sched, _ = make()
    sched.add(make_seq("a", 4, priority=10, max_tokens=4))
    step(sched)
    sched.add(make_seq("b", 40, priority=10))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["a", "b"]
    assert plan.num_new_tokens == [1, 31]  # nothing better than band 10 runs here: no limit


def test_a_worse_band_chunk_beside_a_better_band_gets_the_limit() -> None:
    sched, _ = make()
    sched.add(make_seq("premium", 4, priority=0, max_tokens=20))
    step(sched)
    sched.add(make_seq("batch", 40, priority=10))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium", "batch"]
    assert plan.num_new_tokens == [1, LIMIT]  # not the 31 the token budget leaves
    plan, _ = step(sched)
    assert plan.num_new_tokens == [1, LIMIT]  # its running chunks too, every step
    assert sched.band_limit is not None and sched.band_limit.num_limited == 2


def test_the_limit_is_shared_by_every_worse_band_and_not_by_the_best() -> None:
    sched, _ = make()
    sched.add(make_seq("premium", 4, priority=0, max_tokens=20))
    step(sched)
    sched.add(make_seq("std", 6, priority=5))
    sched.add(make_seq("batch", 40, priority=10))
    sched.add(make_seq("premium2", 20, priority=0))
    plan, _ = step(sched)
    # The premium prompt goes whole; the standard prompt, then the batch one, share LIMIT.
    assert rids(plan.seqs) == ["premium", "premium2", "std", "batch"]
    assert plan.num_new_tokens == [1, 20, 6, 2]


def test_a_better_band_arriving_meets_a_short_step_and_then_runs_whole() -> None:
    sched, _ = make()
    sched.add(make_seq("premium", 4, priority=0, max_tokens=2))
    step(sched)
    step(sched)  # premium finished: band 0 was in use a moment ago
    sched.add(make_seq("batch", 60, priority=10))
    plan, _ = step(sched)
    assert plan.num_new_tokens == [LIMIT]  # the step a new premium request would arrive behind
    sched.add(make_seq("premium3", 24, priority=0))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium3", "batch"]
    assert plan.num_new_tokens == [24, LIMIT]


def test_the_limit_lapses_a_window_after_the_better_band_was_last_seen() -> None:
    sched, now = make()
    assert sched.band_limit is not None
    window = sched.band_limit.window_s
    sched.add(make_seq("premium", 4, priority=0, max_tokens=2))
    step(sched)
    step(sched)  # the premium request finishes at t=0
    sched.add(make_seq("batch", 100, priority=10))
    now[0] = window  # still within the window: limited
    plan, _ = step(sched)
    assert plan.num_new_tokens == [LIMIT]
    now[0] = window + 0.5  # past it: band 10 is the best in use, the whole budget again
    plan, _ = step(sched)
    assert plan.num_new_tokens == [32]
    sched.add(make_seq("premium2", 4, priority=0, max_tokens=50))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium2", "batch"]
    assert plan.num_new_tokens == [4, LIMIT]  # band 0 in use again: limited at once


def test_a_waiting_worse_prompt_admitted_past_the_limit_waits_for_the_next_step() -> None:
    sched, _ = make()
    sched.add(make_seq("premium", 4, priority=0, max_tokens=20))
    step(sched)
    sched.add(make_seq("b1", 12, priority=10))
    sched.add(make_seq("b2", 12, priority=10))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium", "b1"]  # b1 took the share; b2 is not admitted
    assert plan.num_new_tokens == [1, LIMIT]
    assert [s.request_id for s in sched.waiting] == ["b2"]
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium", "b1", "b2"]
    assert plan.num_new_tokens == [1, 4, 4]  # b1's last 4, then b2 the 4 left
    for _ in range(40):
        step(sched)
    assert not sched.has_unfinished() and all_free(sched)


def test_a_one_token_grant_counts_against_the_share() -> None:
    sched, _ = make(limit=9)
    sched.add(make_seq("premium", 4, priority=0, max_tokens=20))
    step(sched)
    for rid in ("b1", "b2", "b3"):
        sched.add(make_seq(rid, 8 if rid == "b1" else 12, priority=10))
    plan, _ = step(sched)
    # b1 whole (8), b2 the one token left of 9; b3 gets none and waits.
    assert rids(plan.seqs) == ["premium", "b1", "b2"]
    assert plan.num_new_tokens == [1, 8, 1]
    assert [s.request_id for s in sched.waiting] == ["b3"]


def test_zero_turns_the_limit_off() -> None:
    sched, _ = make(limit=0)
    assert sched.band_limit is None
    sched.add(make_seq("premium", 4, priority=0, max_tokens=20))
    step(sched)
    sched.add(make_seq("batch", 40, priority=10))
    plan, _ = step(sched)
    assert plan.num_new_tokens == [1, 31]


def test_bad_settings_are_refused() -> None:
    from cluster.config import ConfigError, KVServeConfig

    with pytest.raises(ValueError, match="worse_band_prefill_tokens"):
        SchedulerConfig(worse_band_prefill_tokens=-1)
    with pytest.raises(ConfigError, match="worse_band_prefill_tokens"):
        KVServeConfig.from_dict({"engine": {"worse_band_prefill_tokens": -1}})
    config = KVServeConfig.from_dict({"engine": {"worse_band_prefill_tokens": 256}})
    assert config.engine_config().scheduler.worse_band_prefill_tokens == 256


@pytest.mark.parametrize("limit", [512, 0])
def test_a_simulated_h200_engine_keeps_worse_band_steps_short(limit: int) -> None:
    """The real engine on a sim:h200 device (llama-3-8b): beside a premium request, a batch
    prompt of 2048 tokens goes 512 a step, each step about a quarter of the whole chunk's."""
    from worker.api import SamplingParams
    from worker.config import CacheConfig
    from worker.sim.build import build_sim_engine

    config = SchedulerConfig(max_num_seqs=8, max_model_len=4096, worse_band_prefill_tokens=limit)
    engine = build_sim_engine("llama-3-8b", "h200", config, CacheConfig(num_blocks_override=1024))
    engine.add_request("premium", list(range(1, 17)), SamplingParams(max_tokens=8, ignore_eos=True, priority=0))
    engine.add_request("batch", list(range(100, 2148)), SamplingParams(max_tokens=2, ignore_eos=True, priority=10))
    plans, step_s = [], []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: (plans.append(list(plan.num_new_tokens)), execute(plan))[1]
    for _ in range(4):
        engine.step()
        step_s.append(engine.runner.last_step_s)
    if limit:
        assert plans == [[16, 512], [1, 512], [1, 512], [1, 512]]
        assert max(step_s) < 0.016  # the cost model: about 14 ms a step
    else:
        assert plans[:2] == [[16, 2032], [1, 16]]
        assert step_s[0] > 0.045  # about 52 ms: what a premium request would arrive behind
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
