"""Request priority in the engine (issue 30, "Priorities"): waiting requests are served
by band (lower value first, as vLLM's priority policy), a better band preempts a worse
band's running sequence when it cannot be admitted otherwise, and the preempted sequence
resumes exactly (greedy output unchanged)."""
from __future__ import annotations

from tests.support.scheduler_helpers import make_scheduler, make_seq, rids, step
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.default_model import default_model_path
from worker.sequence import SequenceStatus
from worker.engine.build import build_engine


def test_waiting_requests_are_served_by_band_fifo_within_one() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    for rid, priority in (("low1", 5), ("high1", 0), ("low2", 5), ("high2", 0)):
        sched.add(make_seq(rid, 4, max_tokens=1, priority=priority))
    assert rids(sched.waiting) == ["high1", "high2", "low1", "low2"]


def test_a_better_band_preempts_a_worse_running_sequence() -> None:
    # Finding: no priorities: a premium request waited behind a flood of batch requests.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, prefix_caching=False)
    low_a = make_seq("low-a", 4, max_tokens=20, priority=5)
    low_b = make_seq("low-b", 4, max_tokens=20, priority=5)
    sched.add(low_a), sched.add(low_b)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["low-a", "low-b"] and plan.block_ids == [[0], [1]]
    high = make_seq("high", 4, max_tokens=2, priority=0)
    sched.add(high)
    plan, _ = step(sched)
    # No running slot for it: the worse band's most recently admitted gives its place up.
    assert rids(plan.preempted) == ["low-b"] and low_b.status is SequenceStatus.WAITING
    assert rids(plan.seqs) == ["low-a", "high"] and plan.block_ids == [[0, 2], [3]]  # low-b's block 1 went to the free tail
    assert rids(sched.waiting) == ["low-b"] and low_b.num_tokens == 5  # its sampled token is kept
    # Same band: never preempted for another of its band.
    peer = make_seq("low-c", 4, max_tokens=1, priority=5)
    sched.add(peer)
    plan, _ = step(sched)
    assert plan.preempted == [] and rids(sched.waiting) == ["low-b", "low-c"]


def test_a_preempted_sequence_resumes_exactly() -> None:
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
        cache=CacheConfig(num_blocks_override=64, block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=128),
    )
    engine = build_engine(config)

    def params(max_tokens: int, priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, priority=priority, temperature=0.0, ignore_eos=True)

    low = {"low-a": [1, *range(20, 60)], "low-b": [1, *range(70, 110)]}
    reference = {}
    for rid, prompt in low.items():  # each alone
        engine.add_request(f"ref-{rid}", prompt, params(24, 5))
        out: list[int] = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        reference[rid] = out
    preemptions = engine.scheduler.num_preemptions
    results: dict[str, list[int]] = {rid: [] for rid in (*low, "high")}
    for rid, prompt in low.items():
        engine.add_request(rid, prompt, params(24, 5))
    num_steps = 0
    while engine.has_unfinished():
        if num_steps == 6:  # both low requests are decoding: the premium one takes a place
            engine.add_request("high", [1, *range(120, 160)], params(4, 0))
        for o in engine.step():
            results[o.request_id] += o.new_token_ids
        num_steps += 1
    assert engine.scheduler.num_preemptions == preemptions + 1
    assert results["low-a"] == reference["low-a"] and results["low-b"] == reference["low-b"]
    assert len(results["high"]) == 4
