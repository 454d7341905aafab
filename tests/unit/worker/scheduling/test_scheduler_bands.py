"""The scheduler's band order within a step's token budget, and each key's weighted share
of the running slots within a band (worker/scheduling/bands.py), on a real KVCacheManager."""
from __future__ import annotations

from collections import Counter

from tests.support.scheduler_helpers import all_free, make_scheduler, make_seq, rids, step
from worker.sequence import Sequence


def held(sched: object, band: int = 0) -> dict[str, int]:
    """Running sequences per key of `band`."""
    counts = Counter(s.params.tenant for s in sched.running if s.params.priority == band)  # type: ignore[attr-defined]
    return dict(counts)


def keyed(rid: str, tenant: str, weight: int = 1, prompt: int = 4, max_tokens: int = 50, priority: int = 0) -> Sequence:
    return make_seq(rid, prompt, max_tokens=max_tokens, tenant=tenant, tenant_weight=weight, priority=priority)


# ---------------------------------------------------------------- band order in the budget


def test_better_waiting_prompt_takes_the_budget_before_a_worse_running_chunk() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=128)
    batch = make_seq("batch", 40, priority=10)
    sched.add(batch)
    plan, _ = step(sched)
    assert plan.num_new_tokens == [16]  # its first chunk: 24 tokens still to prefill
    premium = make_seq("premium", 12, priority=0)
    sched.add(premium)
    plan, _ = step(sched)
    # The premium prompt goes first, whole; the batch chunk gets what is left.
    assert rids(plan.seqs) == ["premium", "batch"]
    assert plan.num_new_tokens == [12, 4]
    assert premium.num_output_tokens == 1
    assert batch.num_computed_tokens == 20
    plan, _ = step(sched)
    # Nothing waits; the premium decode still goes before the batch chunk.
    assert rids(plan.seqs) == ["premium", "batch"]
    assert plan.num_new_tokens == [1, 15]


def test_a_worse_waiting_prompt_does_not_pass_a_better_running_chunk() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=128)
    premium = make_seq("premium", 40, priority=0)
    sched.add(premium)
    step(sched)
    sched.add(make_seq("batch", 12, priority=10))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["premium"]
    assert plan.num_new_tokens == [16]


def test_a_worse_band_admitted_after_the_better_ones_within_the_same_step() -> None:
    # Deferred chunks of band 10 run after waiting bands < 10, and before waiting band 10.
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_model_len=128)
    old = make_seq("old", 40, priority=10)
    sched.add(old)
    step(sched)  # 32 of its 40
    sched.add(make_seq("std", 8, priority=5))
    sched.add(make_seq("new", 8, priority=10))
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["std", "old", "new"]
    assert plan.num_new_tokens == [8, 8, 8]
    for _ in range(60):
        step(sched)
    assert all_free(sched)


# ---------------------------------------------------------------- key shares


def test_a_flooding_key_gets_its_share_and_the_other_key_the_rest() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(6):
        sched.add(keyed(f"a{i}", "a"))
    sched.add(keyed("b0", "b"))
    sched.add(keyed("b1", "b"))
    plan, _ = step(sched)
    # share = 4 * 1 / 2 = 2 each: two of a's, then b's two go past a's other four.
    assert rids(plan.seqs) == ["a0", "a1", "b0", "b1"]
    assert held(sched) == {"a": 2, "b": 2}
    assert rids(sched.waiting) == ["a2", "a3", "a4", "a5"]


def test_weights_split_the_slots() -> None:
    sched = make_scheduler(max_num_seqs=8)
    for i in range(8):
        sched.add(keyed(f"a{i}", "a", weight=3))
    for i in range(8):
        sched.add(keyed(f"b{i}", "b", weight=1))
    step(sched)
    assert held(sched) == {"a": 6, "b": 2}  # 8 * 3/4 and 8 * 1/4


def test_a_lone_key_takes_every_slot_and_gives_back_its_excess_when_another_arrives() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(6):
        sched.add(keyed(f"a{i}", "a"))
    step(sched)
    assert held(sched) == {"a": 4}  # nobody else waits: no share to keep
    sched.add(keyed("b0", "b"))
    sched.add(keyed("b1", "b"))
    plan, _ = step(sched)
    # b is under its share (2) and finds no slot: a's most recent gives its slot, one per
    # step as for a better band.
    assert rids(plan.preempted) == ["a3"]
    assert plan.preempted_for_priority == 1
    assert held(sched) == {"a": 3, "b": 1}
    plan, _ = step(sched)
    assert rids(plan.preempted) == ["a2"]
    assert held(sched) == {"a": 2, "b": 2}
    assert rids(sched.waiting) == ["a2", "a3", "a4", "a5"]
    for _ in range(3):  # settled: nobody is over its share, nothing moves back
        plan, _ = step(sched)
        assert not plan.preempted
        assert held(sched) == {"a": 2, "b": 2}


def test_shares_are_per_band_and_never_cross_bands() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(4):
        sched.add(keyed(f"a{i}", "a", priority=0))
    step(sched)
    for i in range(2):
        sched.add(keyed(f"b{i}", "b", priority=5))
    plan, _ = step(sched)
    # b is of a worse band: a's slots are a's (band 0 has one key), nothing is preempted.
    assert not plan.preempted
    assert held(sched, 0) == {"a": 4}
    assert rids(sched.waiting) == ["b0", "b1"]


def test_one_key_stays_fifo_and_finishes_clean() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [keyed(f"a{i}", "a", max_tokens=3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["a0", "a1"]
    for _ in range(12):
        step(sched)
    assert all(s.is_finished for s in seqs)
    assert sched.num_preemptions == 0
    assert all_free(sched)
    assert not sched._waiting_keys  # the per-key waiting counts empty with the queue


def test_abort_of_a_waiting_sequence_updates_its_keys_count() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a0, a1, b0 = keyed("a0", "a"), keyed("a1", "a"), keyed("b0", "b")
    for s in (a0, a1, b0):
        sched.add(s)
    step(sched)
    sched.finish(b0, "abort")
    sched.finish(a1, "abort")
    assert not sched._waiting_keys
    sched.finish(a0, "abort")
    assert all_free(sched)
