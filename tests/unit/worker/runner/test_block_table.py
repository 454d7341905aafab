"""The persistent block table (worker/runner/block_table.py): rows per table list, only new
ids written, rows rewritten for a new list, slots of absent tables reused; and host_batch
over it gives the same slots and table rows as the per-step padded table."""
from __future__ import annotations

import pytest
import torch

from worker.runner.block_table import PersistentBlockTable
from worker.runner.inputs import attention_metadata, host_batch
from worker.sampling_params import SamplingParams
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence


def _plan(tables: list[list[int]], num_new: list[int] | None = None,
          seqs: list[Sequence] | None = None) -> SchedulerOutput:
    seqs = seqs or [Sequence(f"r{i}", [1] * 4, SamplingParams()) for i in range(len(tables))]
    return SchedulerOutput(seqs=seqs, num_new_tokens=num_new or [1] * len(tables), block_ids=tables)


def test_rows_hold_exact_ids_and_gather_in_order() -> None:
    t = PersistentBlockTable(4, 6, torch.device("cpu"), fill_block=99)
    a, b = [3, 7], [5]
    slots = t.sync(_plan([a, b]), [1, 0])
    assert slots.tolist() == [0, 1]  # b claimed slot 0, a slot 1
    assert t.host[0].tolist() == [5, 99, 99, 99, 99, 99]
    assert t.host[1].tolist() == [3, 7, 99, 99, 99, 99]
    assert torch.equal(t.device_table, torch.from_numpy(t.host))
    assert t.gather(slots)[:, :2].tolist() == [[5, 99], [3, 7]]


def test_a_step_writes_only_the_new_ids() -> None:
    t = PersistentBlockTable(2, 4, torch.device("cpu"))
    a = [3, 7]
    t.sync(_plan([a]), [0])
    t.device_table[0, 0] = -1  # a marker: a rewrite of the row would clear it
    a.append(11)
    t.sync(_plan([a]), [0])
    assert t.device_table[0].tolist() == [-1, 7, 11, 0]
    assert t.host[0].tolist() == [3, 7, 11, 0]


def test_a_new_list_for_the_same_request_is_written_whole() -> None:
    t = PersistentBlockTable(3, 4, torch.device("cpu"))
    seq = [Sequence("r0", [1], SamplingParams())]
    t.sync(_plan([[3, 7]], seqs=seq), [0])
    slots = t.sync(_plan([[8]], seqs=seq), [0])  # preempted and admitted again: a new list
    assert t.host[slots[0], 0] == 8


def test_absent_tables_give_their_slots_up_when_rows_run_out() -> None:
    t = PersistentBlockTable(2, 4, torch.device("cpu"))
    a, b, c = [1], [2], [3]
    t.sync(_plan([a, b]), [0, 1])
    slots = t.sync(_plan([a, c]), [0, 1])  # b is absent: c takes its slot
    assert slots.tolist() == [0, 1]  # a kept slot 0; c took b's slot 1
    assert t.host[0, 0] == 1 and t.host[1, 0] == 3
    back = t.sync(_plan([b, a]), [0, 1])  # b comes back: c absent, b written whole again
    assert t.host[back[0], 0] == 2


def test_a_shrunk_table_is_rewritten_where_it_grows_back() -> None:
    t = PersistentBlockTable(1, 4, torch.device("cpu"))
    a = [1, 2, 3]
    t.sync(_plan([a]), [0])
    a.pop()
    t.sync(_plan([a]), [0])
    a.append(9)
    t.sync(_plan([a]), [0])
    assert t.device_table[0, :3].tolist() == [1, 2, 9]


def test_limits_are_refused() -> None:
    t = PersistentBlockTable(1, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the 2 columns"):
        t.sync(_plan([[1, 2, 3]]), [0])
    with pytest.raises(RuntimeError, match="more than the 1 rows"):
        t.sync(_plan([[1], [2]]), [0, 1])


def test_host_batch_over_persistent_tables_matches_the_padded_tables() -> None:
    """Decodes and a prompt chunk over several steps: the same slots, and the device
    table's first cdiv(context) entries per row equal the per-step table's."""
    bs = 4
    t = PersistentBlockTable(8, 8, torch.device("cpu"), fill_block=0)
    seqs = [Sequence(f"r{i}", list(range(10 + 3 * i)), SamplingParams()) for i in range(3)]
    tables = [[5, 6, 7], [1, 2, 3, 4], [9, 10, 11, 12]]
    for seq, n in zip(seqs[:2], (9, 12)):
        seq.num_computed_tokens = n  # decoding their last prompt token
    for step in range(3):
        plan = _plan(tables, [1, 1, 4], seqs)
        order = [0, 1, 2]
        ref = host_batch(plan, order, bs, 1)
        got = host_batch(plan, order, bs, 1, t)
        assert torch.equal(ref.slot_mapping, got.slot_mapping)
        assert got.block_table is None and got.device_table is not None
        for row, ctx in enumerate(ref.context_lens.tolist()):
            width = -(-ctx // bs)
            assert got.device_table[row, :width].tolist() == ref.block_table[row, :width].tolist()  # type: ignore[index]
        meta = attention_metadata(got, bs, 1, torch.device("cpu"), varlen=True)
        assert meta.block_table is got.device_table
        for seq, n in zip(seqs, plan.num_new_tokens):
            seq.token_ids.extend([0] * (n if seq is seqs[2] else 1))
            seq.num_computed_tokens += n
        tables[0].append(20 + step)  # a new block mid-run
        tables[2].append(30 + step)
    assert t.host[0, :6].tolist() == [5, 6, 7, 20, 21, 0]  # 22 joins at its next step


def test_a_table_the_cache_manager_shrank_and_grew_back_is_rewritten() -> None:
    """Lookahead blocks of rejected drafts go back (KVCacheManager.shrink) and the next
    step grows the table to its old length with other blocks: same length, new ids."""
    from kv.cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=16, block_size=4)
    table = kv.allocate("r", 12)  # 3 blocks: the last one a draft's lookahead
    t = PersistentBlockTable(2, 8, torch.device("cpu"))
    seq = [Sequence("r", [1] * 9, SamplingParams())]
    t.sync(_plan([table], seqs=seq), [0])
    lookahead = table[2]
    kv.shrink("r", 8)
    kv.pool.allocate(1)  # someone else takes the freed block first
    assert kv.allocate("r", 12) is table and table[2] != lookahead
    t.sync(_plan([table], seqs=seq), [0])
    assert t.device_table[0, :3].tolist() == table
