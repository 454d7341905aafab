"""Step inputs staged in one copy per dtype (worker/runner/staging.py): parts come back
equal, in order, as copies; the ring grows when a step outgrows it; and the staged varlen
metadata equals the one built tensor by tensor."""
from __future__ import annotations

import torch

from worker.runner.block_table import PersistentBlockTable
from worker.runner.inputs import attention_metadata, host_batch, staged_inputs
from worker.runner.staging import InputStaging
from worker.sampling_params import SamplingParams
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence


def test_parts_come_back_equal_in_order_and_as_copies() -> None:
    staging = InputStaging(torch.device("cpu"), capacity=4, depth=2, pack_on_cpu=True)
    a, b, c = torch.arange(5), torch.tensor([7, 8], dtype=torch.int32), torch.tensor([9])
    for _ in range(3):  # wraps the ring; the 5 + 1 longs outgrow its capacity of 4
        out = staging.upload([a, b, c])
        assert [t.tolist() for t in out] == [a.tolist(), b.tolist(), c.tolist()]
        assert [t.dtype for t in out] == [torch.long, torch.int32, torch.long]
        assert out[0].data_ptr() != a.data_ptr()
    assert staging._rings[torch.long].buffers[0].numel() >= 6


def test_without_a_device_to_copy_to_the_parts_are_returned_as_they_are() -> None:
    a = torch.arange(3)
    assert InputStaging(torch.device("cpu")).upload([a])[0] is a


def test_staged_metadata_equals_the_one_built_tensor_by_tensor() -> None:
    seqs = [Sequence(f"r{i}", list(range(9 + 4 * i)), SamplingParams()) for i in range(3)]
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 8, 12
    plan = SchedulerOutput(seqs=seqs, num_new_tokens=[1, 1, 17], block_ids=[[4, 5], [6, 7, 8, 9], [1, 2, 3, 10, 11]])
    tables = PersistentBlockTable(8, 8, torch.device("cpu"))
    batch = host_batch(plan, [0, 1, 2], 4, 1, tables)
    ref = attention_metadata(batch, 4, 1, torch.device("cpu"), varlen=True)
    got = staged_inputs(batch, InputStaging(torch.device("cpu"), pack_on_cpu=True))
    for name in ("slot_mapping", "cu_seqlens_q", "seqused_k", "block_table"):
        assert torch.equal(getattr(got.meta, name), getattr(ref, name)), name
    assert (got.meta.max_query_len, got.meta.max_context_len, got.meta.num_decode_tokens) == \
        (ref.max_query_len, ref.max_context_len, ref.num_decode_tokens)
    assert torch.equal(got.input_ids, batch.input_ids) and torch.equal(got.positions, batch.positions)
    assert got.last_token_idx.tolist() == batch.last_token_idx == [0, 1, 18]
