"""The scheduler with KV tiers below the device: a prefix found in a lower tier admits its
sequence into `loading` with exact block ids, the step runs without it, and finish_load
moves it to running with the loaded blocks computed and cached."""
from __future__ import annotations

from kv.block_hash import hash_full_blocks
from tests.support.scheduler_helpers import TOKEN, all_free, make_scheduler, make_seq, rids, step
from worker.sequence import SequenceStatus


class SetTiers:
    """A lower tier as the scheduler sees it: a set of held block hashes."""

    def __init__(self, hashes: list[int]) -> None:
        self.held = set(hashes)

    def num_available(self, block_hashes: list[int]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.held:
            n += 1
        return n


def test_tier_prefix_is_loaded_not_recomputed() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    hashes = hash_full_blocks(prompt, 4)
    sched.tiers = SetTiers(hashes)
    other = make_seq("o", 3)
    sched.add(other)
    step(sched)
    a = make_seq("a", prompt, max_tokens=2)
    sched.add(a)
    assert sched.waiting_uncached_tokens() == 2  # only the tail is work
    plan = sched.schedule()
    assert rids(plan.seqs) == ["o"]  # the loading sequence takes no part in this step
    assert [(ld.seq.request_id, ld.block_hashes, ld.block_ids) for ld in plan.kv_loads] == [
        ("a", hashes, [1, 2, 3])]
    assert a.status is SequenceStatus.LOADING and sched.loading == [a]
    sched.update(plan, [TOKEN])
    sched.finish_load(a, 3)
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 12
    assert a.num_cached_tokens == 12
    assert [sched.kv.pool.cached[h].block_id for h in hashes] == [1, 2, 3]
    plan = sched.schedule()
    assert rids(plan.seqs) == ["o", "a"] and plan.num_new_tokens == [1, 2]
    assert plan.block_ids[1] == [1, 2, 3, 5]  # o took block 4 for its fifth token, first
    sched.update(plan, [TOKEN, TOKEN])
    while sched.has_unfinished():
        step(sched)
    assert all_free(sched)


def test_device_hits_then_tier_blocks_and_a_short_load() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(200, 218))  # 4 full blocks + 2
    first = make_seq("first", prompt[:8], max_tokens=1)
    sched.add(first)
    step(sched)  # blocks 0, 1 cached on the device
    hashes = hash_full_blocks(prompt, 4)
    sched.tiers = SetTiers(hashes[2:])
    b = make_seq("b", prompt, max_tokens=1)
    sched.add(b)
    plan = sched.schedule()
    (load,) = plan.kv_loads
    assert load.block_hashes == hashes[2:4] and load.block_ids == [2, 3]
    assert b.num_computed_tokens == 8  # the device hits
    sched.finish_load(b, 1)  # the second block failed its check: computed instead
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    plan = sched.schedule()
    assert plan.num_new_tokens == [6] and plan.block_ids == [[0, 1, 2, 3, 4]]


def test_abort_while_loading_frees_blocks_and_a_late_finish_is_ignored() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    prompt = list(range(300, 309))
    sched.tiers = SetTiers(hash_full_blocks(prompt, 4))
    a = make_seq("a", prompt)
    b = make_seq("b", 5)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.seqs == [] and len(plan.kv_loads) == 1
    assert sched.waiting[0] is b  # a loading sequence holds its max_num_seqs slot
    sched.finish(a, "abort")
    assert a.is_finished and sched.loading == [] and all_free(sched)
    sched.finish_load(a, 2)
    assert sched.running == [] and all_free(sched)
