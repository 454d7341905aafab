"""How much memory the largest forward needs on top of the weights (for KV sizing on GPU).

The KV cache takes what is left of `gpu_memory_utilization`, so the activations of the
biggest step the scheduler can plan (max_num_batched_tokens tokens, logits for up to
max_num_seqs rows) must be measured first: one forward of that size runs over a one-block
scratch cache, and the allocator's peak above its starting point is the answer.

The dummy batch is fresh prompts of at most max_model_len tokens each, every logical
block mapped to scratch block 0 (the values are garbage; only the memory matters).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kv.kv_cache import KVCacheSpec, allocate_kv_cache
from worker.attention.base import AttentionMetadata, PrefillInfo


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int, device: torch.device, varlen: bool
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta) for num_tokens tokens of fresh prompts, all KV in block 0."""
    lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    max_blocks = -(-max(lens) // block_size)
    zeros_table = torch.zeros(max_blocks, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        num_decode_tokens=0,
        prefills=[PrefillInfo(s, n, n, zeros_table[: -(-n // block_size)]) for s, n in zip(starts, lens)],
    )
    if varlen:
        cu = torch.tensor([0] + [s + n for s, n in zip(starts, lens)], dtype=torch.int32)
        meta.cu_seqlens_q = cu.to(device)
        meta.seqused_k = torch.tensor(lens, dtype=torch.int32, device=device)
        meta.block_table = torch.zeros((len(lens), max_blocks), dtype=torch.int32, device=device)
        meta.max_query_len = max(lens)
        meta.max_context_len = max(lens)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return input_ids, positions, meta


@torch.inference_mode()
def activation_peak_bytes(
    model: torch.nn.Module,
    spec: KVCacheSpec,
    num_tokens: int,
    num_logit_rows: int,
    max_model_len: int,
    device: torch.device,
    varlen: bool,
) -> int:
    """Peak bytes allocated by one forward of num_tokens tokens (+ logits for
    num_logit_rows of them) above what was allocated before it. CUDA only."""
    # One block per model layer, whatever the KV groups (a profile reads no real tables).
    scratch = allocate_kv_cache(replace(spec, num_layers=len(model.layers)), 1, device)
    input_ids, positions, meta = profile_batch(num_tokens, max_model_len, spec.block_size, device, varlen)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(input_ids, positions, scratch, meta)
    model.compute_logits(hidden[: min(num_logit_rows, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden
    torch.cuda.empty_cache()  # hand the profile's blocks back so mem_get_info sees them free
    return peak
