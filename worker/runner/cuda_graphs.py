"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed each step.

A decode-only step launches ~10 kernels per layer for a few microseconds of work each; at
small batch the launches, not the GPU, set the step time. A graph replays them all in one
launch. Graphs bake in tensor addresses and shapes, so:

- inputs live in persistent buffers sized for the largest bucket; a step copies its real
  rows into rows [0, n) and pads rows [n, bucket) (below), then replays the bucket's graph;
- attention must be shape-static per bucket: the varlen backends (triton, flash) read the
  per-row context length and block table from device memory, so one capture serves every
  context length. (The torch backend's decode groups are host-side: no graphs with it.)

Padded rows [n, bucket) are harmless by construction: token 0 at position 0 with context
length 1, a block table pointing at the scratch block, and their K/V written into the
scratch slot. The scratch block is one extra physical block past the pool's num_blocks, so
the block pool never hands it to a sequence. Their outputs are computed and ignored.

    persistent buffers (B = largest bucket, W = cdiv(max_model_len, block_size)):
      input_ids (B,) long    positions (B,) long    slot_mapping (B,) long
      block_table (B, W) int32    seqused_k (B,) int32    cu_seqlens_q (B+1,) = 0..B

Each graph also holds the LM head and the greedy argmax behind the model (worker/runner/
lm_head.py): its outputs are the hidden states, the logits (model dtype where the model
offers it) and the argmax ids of the bucket's rows. All three are views of graph memory,
overwritten by the next replay: every read of them (the sampler, the next step's input
gather, the host copy of the ids) is queued on the stream before that replay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from worker.attention.base import AttentionMetadata
from worker.runner.lm_head import greedy_ids, head_logits

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself: a batch pads
    to the next bucket, wasting < 2x rows on tiny batches and never more than needed at the top."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding num_seqs rows, or None when it exceeds the largest."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass
class DecodeBuffers:
    """The persistent device inputs of the captured decode graphs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scratch_block: int
    block_size: int

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks_per_seq: int, scratch_block: int, block_size: int, device: torch.device
    ) -> DecodeBuffers:
        return cls(
            input_ids=torch.zeros(max_batch, dtype=torch.long, device=device),
            positions=torch.zeros(max_batch, dtype=torch.long, device=device),
            slot_mapping=torch.full((max_batch,), scratch_block * block_size, dtype=torch.long, device=device),
            block_table=torch.full((max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device),
            seqused_k=torch.ones(max_batch, dtype=torch.int32, device=device),
            # one query token per row: row r owns flat token r
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            scratch_block=scratch_block,
            block_size=block_size,
        )

    def fill(
        self,
        input_ids: torch.Tensor,  # (n,) long, host or device
        positions: torch.Tensor,  # (n,) long
        slot_mapping: torch.Tensor,  # (n,) long
        block_table: torch.Tensor,  # (n, w) with w <= W
        context_lens: torch.Tensor,  # (n,)
        bucket: int,
    ) -> None:
        """Rows [0, n) get the step's inputs; rows [n, bucket) the harmless padding.
        Columns of block_table past w keep stale ids: a row reads only its first
        cdiv(context_len, block_size) entries, all of which are written here."""
        n, w = block_table.shape
        if n > bucket or bucket > self.input_ids.shape[0] or w > self.block_table.shape[1]:
            raise ValueError(f"{n} rows x {w} blocks do not fit bucket {bucket} of buffers "
                             f"{tuple(self.block_table.shape)}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_table[:n, :w].copy_(block_table, non_blocking=True)
        self.seqused_k[:n].copy_(context_lens, non_blocking=True)
        if bucket > n:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(self.scratch_block * self.block_size)
            self.block_table[n:bucket, 0].fill_(self.scratch_block)
            self.seqused_k[n:bucket].fill_(1)

    def metadata(self, bucket: int, max_context_len: int) -> AttentionMetadata:
        """Views of the buffers for a bucket: the same storage at capture and at replay.
        max_context_len is an upper bound (max_model_len), baked into the graph."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            seqused_k=self.seqused_k[:bucket],
            block_table=self.block_table[:bucket],
            max_query_len=1,
            max_context_len=max_context_len,
        )


# (input_ids, positions, meta) -> hidden states (T, hidden); kv caches are bound inside.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# hidden states (T, hidden) -> (logits (T, V'), greedy ids (T,))
DecodeHead = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class GraphOutputs:
    """A replay's outputs for its n real rows (views of graph memory)."""

    hidden: torch.Tensor  # (n, hidden)
    logits: torch.Tensor  # (n, V')
    greedy_ids: torch.Tensor  # (n,) long


class DecodeGraphs:
    """Captures `forward` once per bucket and replays it for decode-only steps."""

    def __init__(self, forward: DecodeForward, head: DecodeHead, buffers: DecodeBuffers, sizes: list[int],
                 max_context_len: int) -> None:
        self.forward = forward
        self.head = head
        self.buffers = buffers
        self.sizes = sizes
        self.max_context_len = max_context_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller ones reuse its memory pool blocks."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in sorted(self.sizes, reverse=True):
                meta = self.buffers.metadata(bucket, self.max_context_len)
                ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
                for _ in range(2):  # warm-up outside the graph: kernel autotuning, lazy init
                    self.head(self.forward(ids, pos, meta))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden = self.forward(ids, pos, meta)
                    self.outputs[bucket] = (hidden, *self.head(hidden))
                pool = graph.pool()
                self.graphs[bucket] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured decode for batch sizes %s", sorted(self.graphs))

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def fits(self, num_seqs: int, table_width: int) -> bool:
        """Whether a decode-only step of this shape can replay a graph (else: eager)."""
        return self.bucket(num_seqs) is not None and table_width <= self.buffers.block_table.shape[1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> GraphOutputs:
        """The outputs of a decode-only step of n <= max bucket rows: views of the graph's
        memory, read before the next replay."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        if bucket is None or bucket not in self.graphs:
            raise ValueError(f"no captured graph for {n} sequences (buckets {sorted(self.graphs)})")
        self.buffers.fill(input_ids, positions, slot_mapping, block_table, context_lens, bucket)
        self.graphs[bucket].replay()
        hidden, logits, ids = self.outputs[bucket]
        return GraphOutputs(hidden[:n], logits[:n], ids[:n])


def cuda_graphs_off_reason(enabled: bool, device: torch.device, backend: Any, tp_size: int,
                           num_kv_groups: int) -> str | None:
    """Why decode steps cannot replay graphs here (logged once), or None when they can.
    Graphs need CUDA, a shape-static attention path (varlen backends) and a single rank
    (NCCL collectives inside a captured graph are not attempted)."""
    why_not = None
    if not enabled:
        why_not = "enable_cuda_graphs is off"
    elif device.type != "cuda":
        why_not = f"device is {device.type}"
    elif not backend.varlen:
        why_not = f"the {backend.name} attention backend is not shape-static per batch size"
    elif tp_size > 1:
        why_not = "tensor parallelism"
    elif num_kv_groups > 1:
        why_not = "the model's layers keep KV in several groups (kv/kv_groups.py)"
    if why_not is not None:
        logger.info("CUDA graphs off (%s): decode steps run eagerly", why_not)
    return why_not


def capture_decode_graphs(model: Any, kv_caches: torch.Tensor, vocab_size: int, logits_in_model_dtype: bool,
                          max_num_seqs: int, max_model_len: int, num_blocks: int, block_size: int,
                          device: torch.device) -> DecodeGraphs:
    """Buffers for the largest bucket and one captured graph per bucket: the model over
    `kv_caches`, then the LM head and the greedy argmax. `num_blocks` is the scratch block
    (one past the pool's: the caller allocated it)."""
    sizes = graph_batch_sizes(max_num_seqs)
    buffers = DecodeBuffers.allocate(sizes[-1], -(-max_model_len // block_size), num_blocks, block_size, device)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, positions, kv_caches, meta)

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head_logits(model.compute_logits, hidden, logits_in_model_dtype)
        return logits, greedy_ids(logits, vocab_size)

    graphs = DecodeGraphs(forward, head, buffers, sizes, max_model_len)
    graphs.capture()
    return graphs
