"""Decode CUDA graphs: bucket choice and the persistent-buffer filling/padding (pure tensor
code, checked on CPU); the capture and replay itself needs a GPU."""
from __future__ import annotations

import pytest
import torch

from worker.runner.cuda_graphs import DecodeBuffers, DecodeGraphs, bucket_for, graph_batch_sizes

BLOCK_SIZE = 4
SCRATCH = 9  # the block past the pool's 9 blocks


def test_batch_sizes_double_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize(("num_seqs", "bucket"), [(1, 1), (3, 4), (4, 4), (17, 32), (33, 48), (48, 48), (49, None)])
def test_bucket_is_the_smallest_that_fits(num_seqs: int, bucket: int | None) -> None:
    assert bucket_for(num_seqs, graph_batch_sizes(48)) == bucket


def test_fill_copies_rows_and_pads_the_rest_harmlessly() -> None:
    buffers = DecodeBuffers.allocate(8, 5, SCRATCH, BLOCK_SIZE, torch.device("cpu"))
    buffers.block_table.fill_(7)  # stale ids from an earlier, longer step
    buffers.fill(
        input_ids=torch.tensor([11, 12, 13]),
        positions=torch.tensor([5, 0, 8]),
        slot_mapping=torch.tensor([1 * 4 + 1, 2 * 4 + 0, 3 * 4 + 0]),
        block_table=torch.tensor([[0, 1], [2, 0], [6, 5]]),
        context_lens=torch.tensor([6, 1, 9]),
        bucket=4,
    )
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 8, 0]
    assert buffers.slot_mapping[:4].tolist() == [5, 8, 12, SCRATCH * BLOCK_SIZE]
    assert buffers.seqused_k[:4].tolist() == [6, 1, 9, 1]
    assert buffers.block_table[:3, :2].tolist() == [[0, 1], [2, 0], [6, 5]]
    assert buffers.block_table[3, 0].item() == SCRATCH  # the padded row reads only the scratch block
    meta = buffers.metadata(4, max_context_len=20)
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_table.shape == (4, 5) and meta.max_query_len == 1
    # views, not copies: a later fill is what the captured graph reads
    assert meta.seqused_k.data_ptr() == buffers.seqused_k.data_ptr()


def test_fill_refuses_rows_that_do_not_fit() -> None:
    buffers = DecodeBuffers.allocate(4, 2, SCRATCH, BLOCK_SIZE, torch.device("cpu"))
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill(one, one, one, torch.zeros((1, 3), dtype=torch.long), one, bucket=1)


def test_a_step_that_does_not_fit_the_buffers_runs_eagerly() -> None:
    # The runner asks `fits` before replaying; a wider block table than the buffers (or
    # more rows than the largest bucket) must take the eager path, not fail the step.
    buffers = DecodeBuffers.allocate(4, 2, SCRATCH, BLOCK_SIZE, torch.device("cpu"))
    graphs = DecodeGraphs(lambda ids, pos, meta: ids, lambda h: (h, h), buffers, [1, 2, 4], max_context_len=32)
    assert graphs.fits(3, 2) and not graphs.fits(3, 3) and not graphs.fits(5, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_matches_eager_decode() -> None:
    """A toy 'model' (attention only, triton backend) captured per bucket gives the eager result."""
    pytest.importorskip("triton", reason="the triton backend needs triton (test extra, Linux x86-64)")
    from tests.unit.worker.runner.test_attention import D, _build_batch
    from worker.attention.triton_paged import TritonPagedAttention
    from worker.runner.cuda_graphs import DecodeGraphs

    specs = [(5, 1), (12, 1), (30, 1)]
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cuda"))
    num_blocks = kv_cache.shape[1]
    cache = torch.cat([kv_cache, torch.zeros_like(kv_cache[:, :1])], dim=1)  # + scratch block
    backend = TritonPagedAttention()
    q_in, k_in, v_in = torch.zeros(4, *q.shape[1:], device="cuda"), torch.zeros(4, *k.shape[1:], device="cuda"), \
        torch.zeros(4, *v.shape[1:], device="cuda")

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, m: object) -> torch.Tensor:
        n = input_ids.shape[0]
        return backend.forward(q_in[:n], k_in[:n], v_in[:n], cache, m, D**-0.5)

    buffers = DecodeBuffers.allocate(4, 16, num_blocks, kv_cache.shape[2], torch.device("cuda"))
    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = hidden.flatten(1)
        return logits, logits.argmax(dim=-1)

    graphs = DecodeGraphs(forward, head, buffers, [1, 2, 4], max_context_len=64)
    graphs.capture()
    q_in[:3], k_in[:3], v_in[:3] = q, k, v
    out = graphs.run(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), meta.slot_mapping,
                     meta.block_table, meta.seqused_k)
    torch.testing.assert_close(out.hidden.cpu(), ref, rtol=1e-3, atol=1e-3)
    # the head ran inside the graph, on the replay's own hidden states
    assert torch.equal(out.greedy_ids, out.hidden.flatten(1).argmax(dim=-1))
