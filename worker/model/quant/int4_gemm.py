"""A dequantizing int4 GEMM in Triton: y = x @ W^T with W held as packed 4-bit integers,
dequantized tile by tile in registers (never materialised whole), for int4 checkpoints
(AWQ, GPTQ, compressed-tensors W4A16) on CUDA. Runs on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check it against `int4_gemm_torch`.

The weight layout (K = in features, N = out features, G = K / group):

    qweight (K / 8, N) int32: W[n, k]'s integer at bits 4 (k % 8) of qweight[k // 8, n]
    scales  (G, N) float, zeros (G, N) float (the zero point, unpacked)
    W[n, k] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n]

This is GPTQ's packing (along K) with its zero points unpacked (stored zero + 1); AWQ's
(packed along N, interleaved) and compressed-tensors' (along K per row) are repacked into
it at load by `pack_k_major`. Each program owns a (BLOCK_M, BLOCK_N) tile of y and walks K.
"""
from __future__ import annotations

import torch

from worker.attention.triton_support import tl, triton


def pack_k_major(q: torch.Tensor) -> torch.Tensor:
    """(K, N) integers in [0, 16) -> (K / 8, N) int32 words, row k at bits 4 (k % 8)."""
    k, n = q.shape
    grouped = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 8, 1)
    words = (grouped << shifts).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int4_gemm_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """The reference: dequantize W whole, then one matmul (fp32)."""
    k = qweight.shape[0] * 8
    shifts = (torch.arange(8, dtype=torch.int32, device=qweight.device) * 4).view(1, 8, 1)
    q = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(k, -1).float()
    w = (q - zeros.float().repeat_interleave(group, 0)[:k]) * scales.float().repeat_interleave(group, 0)[:k]
    return (x.float() @ w).to(x.dtype)


if triton is not None:

    @triton.jit
    def _int4_gemm_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
        stride_xm, stride_qk, stride_sg, stride_om,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            packed = tl.load(qw_ptr + (rk // 8)[:, None] * stride_qk + rn[None, :], mask=w_ok, other=0)
            q = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
            g = rk // GROUP
            s = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :], mask=w_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * stride_sg + rn[None, :], mask=w_ok, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - z) * s  # the tile of W^T, dequantized in registers
            acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION)
        o_offs = rm[:, None] * stride_om + rn[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group: int) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, by the Triton kernel (CUDA, or interpreted)."""
    if triton is None:
        raise RuntimeError("triton is not available: int4_gemm_torch computes the same product")
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * 8 == k and group % 8 == 0 and x.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
