"""Fused elementwise kernels of the decoder layer, in Triton: residual add + RMSNorm, RoPE
of q and k in one launch (optionally writing the rotated key and the value into the
paged KV cache in the same launch), SiLU(gate) * up. Each replaces a chain of small torch ops (an
RMSNorm alone is ~8 launches) with one launch that reads its inputs once.

Every kernel rounds where the torch path (worker/model/layers.py, worker/model/llama.py,
the same arithmetic as transformers) rounds to the model dtype, so that its outputs are
that path's to within the order of a reduction:
- add + RMSNorm: sum rounded to the dtype (it is the residual stream), normalised in fp32,
  cast to the dtype, then scaled by the weight in the weight's and input's common dtype;
- RoPE: cos / sin in the dtype, q*cos and rotate_half(q)*sin each rounded, then their sum;
- SiLU * up: SiLU in fp32 rounded to the dtype, then the product rounded.
The kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check them; worker/model/fused.py decides
when they are used.
"""
from __future__ import annotations

import torch

from worker.attention.triton_support import TRITON_IMPORT_ERROR, next_pow2, tl, triton


if triton is not None:

    @triton.jit
    def _round_to(x32, dt: tl.constexpr):
        """fp32 -> `dt`, rounding to nearest even. For bf16 the rounding is done on the
        bits (what the GPU's cast does), so that Triton's interpreter, whose bf16 cast
        truncates, computes what the device computes; finite values only."""
        if dt == tl.bfloat16:
            bits = x32.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dt)
        else:
            return x32.to(dt)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = _round_to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / n_cols
        normed = _round_to(x32 * (1.0 / tl.sqrt(var + eps)), x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, _round_to(out, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
        act = _round_to(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty)
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, _round_to(out, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_heads(x_ptr, stride_t, stride_h, tok, c1, c2, s1, s2,
                    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                    HALF_PAD: tl.constexpr):
        """Rotate-half RoPE of one token's heads, in place; returns the rotated halves."""
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HALF_PAD)[None, :]
        mask = (h < NUM_HEADS) & (d < HALF)
        base = x_ptr + tok * stride_t + h * stride_h
        x1 = tl.load(base + d, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
        dt: tl.constexpr = x_ptr.dtype.element_ty
        a1 = _round_to(x1.to(tl.float32) * c1, dt).to(tl.float32)
        b1 = _round_to(-(x2.to(tl.float32)) * s1, dt).to(tl.float32)
        a2 = _round_to(x2.to(tl.float32) * c2, dt).to(tl.float32)
        b2 = _round_to(x1.to(tl.float32) * s2, dt).to(tl.float32)
        o1 = _round_to(a1 + b1, dt)
        o2 = _round_to(a2 + b2, dt)
        tl.store(base + d, o1, mask=mask)
        tl.store(base + HALF + d, o2, mask=mask)
        return o1, o2

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, key_cache_ptr, value_cache_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
        NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
        NUM_K_HEADS: tl.constexpr, K_HEADS_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, WRITE_KV: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF_PAD)[None, :]
        dm = d < HALF
        # The step's cos / sin rows, already in the model dtype (read once for q and k).
        c1 = tl.load(cos_ptr + tok * stride_ct + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * stride_ct + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
        _rope_heads(q_ptr, stride_qt, stride_qh, tok, c1, c2, s1, s2, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
        k1, k2 = _rope_heads(k_ptr, stride_kt, stride_kh, tok, c1, c2, s1, s2, NUM_K_HEADS, K_HEADS_PAD, HALF,
                             HALF_PAD)
        if WRITE_KV:  # the rotated key and the value into the token's slot of the paged cache
            h = tl.arange(0, K_HEADS_PAD)[:, None]
            mask = (h < NUM_K_HEADS) & dm
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            cache_off = slot * (NUM_K_HEADS * 2 * HALF) + h * (2 * HALF) + d
            tl.store(key_cache_ptr + cache_off, k1, mask=mask)
            tl.store(key_cache_ptr + cache_off + HALF, k2, mask=mask)
            v_base = v_ptr + tok * stride_vt + h * stride_vh + d
            tl.store(value_cache_ptr + cache_off, tl.load(v_base, mask=mask, other=0.0), mask=mask)
            tl.store(value_cache_ptr + cache_off + HALF, tl.load(v_base + HALF, mask=mask, other=0.0), mask=mask)


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError(f"triton is not available ({TRITON_IMPORT_ERROR})")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual); without `residual`, x itself is
    the second element. Rows are the last dimension."""
    _need_triton()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res2, res_out = x2, x2
    else:
        res2 = residual.reshape(-1, n)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            n, eps, HAS_RES=residual is not None, BLOCK=next_pow2(n),
        )
    return out.view(x.shape), res_out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of (T, 2I) rows [gate | up] -> (T, I)."""
    _need_triton()
    num_rows, width = gate_up.shape
    half = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((num_rows, half), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(half))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(half, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), half, BLOCK=block)
    return out


def rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
             slot_mapping: torch.Tensor | None = None) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by the step's (T, D) cos / sin rows
    (model dtype). q, k and v may be strided views (the qkv projection's split). With
    `kv_cache` (2, num_blocks, block_size, Hkv, D), contiguous, of k's dtype, the rotated
    k and v (T, Hkv, D) are also written to the slots `slot_mapping` (T,) names."""
    _need_triton()
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    write = kv_cache is not None
    if write:
        assert v is not None and slot_mapping is not None and v.stride(-1) == 1
        assert kv_cache.is_contiguous() and kv_cache.dtype == k.dtype and kv_cache.shape[-2:] == k.shape[-2:]
    half = head_dim // 2
    v_arg = v if write else k
    if num_tokens:
        _rope_qk_kernel[(num_tokens,)](
            q, k, v_arg, cos, sin, slot_mapping if write else cos, kv_cache[0] if write else k,
            kv_cache[1] if write else k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=next_pow2(num_q_heads),
            NUM_K_HEADS=num_k_heads, K_HEADS_PAD=next_pow2(num_k_heads),
            HALF=half, HALF_PAD=next_pow2(half), WRITE_KV=write,
        )
