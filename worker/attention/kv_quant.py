"""The FP8 KV cache (`engine.kv_cache_dtype: fp8`): e4m3 values, one scale per tensor.

    stored = saturate(x / KV_FP8_SCALE) as float8_e4m3fn      (|stored| <= 448)
    read   = stored.to(compute dtype) * KV_FP8_SCALE

One scale for every K and V element of the pool (per tensor, not per block): a block
is written a token at a time by decodes, so a per-block scale fixed by its first token
would saturate later ones or force re-quantizing the block; and with one scale a pool
block's bytes are exactly half of bf16's, a tier or an export moves them as they are,
and a kernel dequantizes a K/V tile with one multiply. e4m3 is a float: its relative
error (<= 2**-4 of |x| in the normal range) does not depend on the scale, which only
sets where values saturate (448 * scale) and where subnormals start (2**-6 * scale);
the scale 1.0 covers the K/V magnitudes of the models served (as vLLM's default).

Every attention path reads the rounded values, the chunk's own fresh K/V included
(`roundtrip`): a prefix-cache hit then computes exactly what a miss does.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_SCALE = 1.0
E4M3_MAX = 448.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype: the model's (auto) or e4m3 (fp8)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r} ({', '.join(KV_CACHE_DTYPES)})")
    return KV_FP8_DTYPE if name == "fp8" else model_dtype


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == KV_FP8_DTYPE


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Compute-dtype K/V -> e4m3, saturating (never inf / NaN)."""
    return (x.float() / KV_FP8_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Read K/V from the pool in `dtype` (a no-op for a pool in the model's dtype)."""
    if x.dtype == dtype:
        return x
    return (x.to(torch.float32) * KV_FP8_SCALE).to(dtype)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What the FP8 pool gives back for x."""
    return dequantize_kv(quantize_kv(x), x.dtype)
