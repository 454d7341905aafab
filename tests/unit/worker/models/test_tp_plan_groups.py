"""The tensor-parallel plan carries one block table per KV group (full beside sliding
window): position-major, as diffs, through preemption and chunks; entries a sliding group
released after they were sent may stay stale on the other ranks, behind every window."""
from __future__ import annotations

from kv.cache_manager import KVCacheManager
from kv.kv_groups import layout_for_windows
from worker.api import SamplingParams
from worker.config import SchedulerConfig
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence
from worker.tp.plan_codec import PlanDecoder, PlanEncoder

BS, WINDOW = 4, 8


def test_group_tables_round_trip_as_diffs() -> None:
    kv = KVCacheManager(20, BS, True, layout=layout_for_windows([None, WINDOW, None, WINDOW]))
    assert kv.layout.num_groups == 2
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), kv)
    prefix = list(range(3, 11))
    for i, n in enumerate([9, 5, 3, 6]):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        scheduler.add(Sequence(str(i), prefix + [20 + i] * n, params))
    encoder, decoder = PlanEncoder(), PlanDecoder(num_groups=2)
    null = kv.null_block.block_id
    num_preempted = step = num_stale = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        num_preempted += len(plan.preempted)
        if plan.is_empty:
            continue
        got = decoder.decode(encoder.encode(plan))
        assert got is not None and got.num_new_tokens == plan.num_new_tokens
        for seq, table, got_table in zip(plan.seqs, plan.block_ids, got.block_ids):
            assert [len(t) for t in got_table] == [len(t) for t in table]
            assert got_table[0] == table[0]  # the full group: exact
            first = kv.groups[1].first_needed_block(seq.num_computed_tokens, BS)
            assert got_table[1][first:] == table[1][first:]  # every entry a query reads
            stale = [i for i, (a, b) in enumerate(zip(got_table[1], table[1])) if a != b]
            assert all(table[1][i] == null and i < first for i in stale)
            num_stale += len(stale)
        scheduler.update(plan, [100 + step if plan.samples(i) else None for i in range(len(plan.seqs))])
        step += 1
    assert num_preempted > 0 and num_stale > 0
    decoder.decode(encoder.encode(scheduler.schedule()))
    assert encoder.num_known == 0 and decoder.mirror == {}
