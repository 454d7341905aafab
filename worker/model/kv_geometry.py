"""A model's KV geometry: what its pool holds per token, and the attention path that
reads it. One place for the runner and the benchmarks to ask.

    per-head K/V (Llama family):  2 planes x this rank's kv heads x head_dim per layer
    latent (MLA, DeepSeek-V3):    1 row of kv_lora_rank + qk_rope_head_dim per layer
                                  (the arch's `latent_kv` and `kv_cache_spec`)
"""
from __future__ import annotations

from typing import Any

import torch

from kv.kv_cache import KVCacheSpec
from worker.model.parallel import SINGLE, TPContext, kv_head_range


def is_latent(arch: Any) -> bool:
    """An MLA model: its pool holds latent rows and its layers attend themselves."""
    return bool(getattr(arch, "latent_kv", False))


def kv_cache_spec_for(arch: Any, block_size: int, dtype: torch.dtype, tp: TPContext = SINGLE) -> KVCacheSpec:
    """The pool's geometry on rank `tp.rank`: the model's own for MLA, else this rank's
    share of the K/V heads."""
    if is_latent(arch):
        return arch.kv_cache_spec(block_size, dtype)
    kv_lo, kv_hi = kv_head_range(arch.num_heads, arch.num_kv_heads, tp)
    return KVCacheSpec(
        num_layers=arch.num_layers, num_kv_heads=kv_hi - kv_lo, head_dim=arch.head_dim,
        block_size=block_size, dtype=dtype,
    )


def attention_backend_name(arch: Any, requested: str) -> str:
    """MLA layers attend over the latent pool in torch (worker/attention/mla_paged.py)
    and read the torch backend's metadata; another backend asked for is refused."""
    if not is_latent(arch):
        return requested
    if requested not in ("auto", "torch"):
        raise ValueError(f"attention_backend={requested}: multi-head latent attention (DeepSeek-V3) "
                         "runs on its own torch path; use auto or torch")
    return "torch"
