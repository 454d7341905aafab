"""Flash-attention backend (vllm-flash-attn / flash-attn), CUDA only.

Used only when a package imports on CUDA and its build matches the installed torch;
`load_flash_backend` returns None with the reason otherwise, and the caller logs it.

Sliding window: flash-attention's `window_size=(left, right)` lets query i see keys
i - left .. i + right; with causal=True, (window - 1, 0) is transformers' p - window < k <= p.
Not exercised on this project's CPU machines (no flash package loads there); the torch and
triton backends are the ones tested against transformers with a window.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from worker.attention.base import AttentionMetadata, write_kv


def _import_varlen() -> tuple[Callable[..., Any] | None, str]:
    errors = []
    for module in ("vllm_flash_attn", "flash_attn"):
        try:
            mod = __import__(module, fromlist=["flash_attn_varlen_func"])
            return mod.flash_attn_varlen_func, module
        except Exception as e:  # ImportError, or an ABI mismatch raised at import
            errors.append(f"{module}: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


class FlashAttention:
    name = "flash"
    varlen = True  # reads cu_seqlens_q / seqused_k / block_table
    supports_sinks = False  # flash_attn_varlen_func has no sink term

    def __init__(self, varlen_func: Callable[..., Any]) -> None:
        self._varlen = varlen_func

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise ValueError(
                "the flash attention backend does not support attention sinks (gpt-oss); "
                "use attention_backend=triton or torch"
            )
        key_cache, value_cache = write_kv(kv_cache, k, v, meta.slot_mapping)
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        return self._varlen(
            q=q, k=key_cache, v=value_cache,
            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seqused_k, max_seqlen_k=meta.max_context_len,
            softmax_scale=scale, causal=True, block_table=meta.block_table, window_size=window,
        )


def load_flash_backend(device: torch.device) -> tuple[FlashAttention | None, str]:
    """The flash backend, or None and why it cannot be used here."""
    if device.type != "cuda":
        return None, f"flash attention needs CUDA (device is {device.type})"
    func, why = _import_varlen()
    if func is None:
        return None, f"no usable flash-attention package ({why})"
    return FlashAttention(func), why
