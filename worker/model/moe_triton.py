"""Fused MoE in Triton (CUDA): every expert's grouped matmul in ONE kernel launch, with no
host sync (the torch path's per-expert loop needs the group sizes on the host).

Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how the unit
tests check it (tests/support/triton_moe_cases.py).

Alignment (torch ops on the device, shapes fixed by T, K, E and BLOCK_M only):
    pairs j = t * K + k, stable-sorted by expert; each expert's group is padded to a
    multiple of BLOCK_M, so every BLOCK_M-row block of `sorted_pairs` belongs to ONE
    expert (`block_expert`); padding rows hold the sentinel T * K, blocks past the last
    expert's hold expert id E and their programs exit at once.

    sorted_pairs : (T*K + E*(BLOCK_M-1) rounded up to BLOCK_M,) int32  pair id or T*K
    block_expert : (len(sorted_pairs) / BLOCK_M,) int32                 expert or E

Kernel (grid: blocks x N tiles), for the rows of block b (expert e = block_expert[b]):
    out[pair, n] = (sum_k a[row(pair), k] * w[e, n, k] + bias[e, n]) * (weight[pair] if MUL_WEIGHT)
where row(pair) = pair // TOP_K for the first matmul (a = hidden, rows are tokens) and
row(pair) = pair for the second (a = the activated (T*K, I) intermediate). Output rows are
pair ids, so the combine is a (T, K, H) sum over K.
"""
from __future__ import annotations

from typing import Any

import torch

from worker.attention.triton_support import TRITON_IMPORT_ERROR, tl, triton
from worker.costs.shape_parts import moe_tile_rows
from worker.model.moe_activation import MoEActivation, apply_activation


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _moe_matmul_kernel(
        a_ptr, w_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, pair_weight_ptr,
        N, K, num_pairs, num_experts,
        stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
        TOP_K: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr,
        MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        block = tl.program_id(0)
        n_tile = tl.program_id(1)
        expert = tl.load(block_expert_ptr + block)
        if expert < num_experts:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pairs = tl.load(sorted_pairs_ptr + rows)
            row_ok = pairs < num_pairs
            if ROWS_ARE_TOKENS:
                a_rows = pairs // TOP_K
            else:
                a_rows = pairs
            a_rows = tl.where(row_ok, a_rows, 0).to(tl.int64)
            n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None] * stride_wk,
                            mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                acc += tl.dot(a, w, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0)
                acc += bias[None, :].to(tl.float32)
            if MUL_WEIGHT:
                weight = tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)
                acc = acc * weight[:, None].to(tl.float32)
            o_offs = pairs.to(tl.int64)[:, None] * stride_om + n[None, :]
            tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) as the module docstring draws them; device ops only."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount on CUDA reads the max id on the host (a sync that
    # would also break CUDA graph capture).
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    group_start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    # Pair i of the sorted order lands at its expert's padded start + its rank in the group.
    rank_in_group = torch.arange(num_pairs, device=device) - group_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank_in_group
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert  # searchsorted gives E for blocks past the last group


def _matmul(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pair_weights: torch.Tensor | None, num_pairs: int, top_k: int,
    rows_are_tokens: bool, block_m: int,
) -> torch.Tensor:
    num_experts, n, k = w.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    kwargs: dict[str, Any] = {"num_warps": 4, "num_stages": 2} if a.is_cuda else {}
    _moe_matmul_kernel[grid](
        a, w, bias if bias is not None else a, out, sorted_pairs, block_expert,
        pair_weights if pair_weights is not None else a,
        n, k, num_pairs, num_experts,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        TOP_K=top_k, ROWS_ARE_TOKENS=rows_are_tokens, HAS_BIAS=bias is not None,
        MUL_WEIGHT=pair_weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # fp32 models multiply in full fp32 (Triton's fp32 default on NVIDIA is TF32).
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **kwargs,
    )
    return out


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: MoEActivation,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """worker/model/moe.py `grouped_experts`, as two kernel launches and elementwise ops.
    block_m: rows per block (default: 16 while experts see few pairs each, as in decode
    steps, where padding each group to a big block would waste most of it; 64 beyond)."""
    if triton is None:
        raise RuntimeError(f"triton is not available ({TRITON_IMPORT_ERROR})")
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = moe_tile_rows(num_pairs, w13.shape[0])
    inter = w13.shape[1] // 2
    hidden = hidden.contiguous()
    sorted_pairs, block_expert = align_by_expert(topk_ids, w13.shape[0], block_m)
    gate_up = _matmul(hidden, w13, w13_bias, sorted_pairs, block_expert, None, num_pairs, top_k, True, block_m)
    h = apply_activation(gate_up[:, :inter], gate_up[:, inter:], activation).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    y = _matmul(h, w2, w2_bias, sorted_pairs, block_expert, weights, num_pairs, top_k, False, block_m)
    return y.view(num_tokens, top_k, -1).sum(dim=1)
