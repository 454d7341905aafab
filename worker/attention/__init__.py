"""Attention backends: `torch` (default, everywhere), `flash` (CUDA, when a flash-attention
package loads and matches torch) and `triton` (CUDA, the project's own kernel)."""
from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillInfo
from worker.attention.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "PrefillInfo", "select_backend"]

BACKENDS = ("auto", "torch", "flash", "triton")


def _load(name: str, device: torch.device) -> tuple[AttentionBackend | None, str]:
    # Imported lazily: triton_paged imports triton, which a CPU-only install may lack.
    if name == "flash":
        from worker.attention.flash import load_flash_backend  # flash-attn: optional, loaded only when asked for

        return load_flash_backend(device)
    from worker.attention.triton_paged import load_triton_backend  # triton: a CPU-only install may lack it

    return load_triton_backend(device)


def select_backend(
    name: str, device: torch.device, needs_sinks: bool = False, needs_fp8_kv: bool = False
) -> AttentionBackend:
    """`auto`: flash if it loads on this device, else triton if it loads, else torch (on CPU
    always torch); the choice is logged once, with why the faster ones were not used.
    `flash` / `triton` insist: a clear error when they cannot be used. A model with
    attention sinks (`needs_sinks`) never gets flash, which has no sink term; nor does an
    FP8 KV cache (`needs_fp8_kv`: the torch and triton backends dequantize it).
    """
    if needs_fp8_kv and name == "flash":
        raise ValueError("attention_backend=flash cannot read an FP8 KV cache (kv_cache_dtype=fp8); "
                         "use triton, torch or auto")
    no_flash = "the model has attention sinks" if needs_sinks else "the KV cache is FP8" if needs_fp8_kv else ""
    needs_sinks = needs_sinks or needs_fp8_kv  # both rule flash out of `auto` alike
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)})")
    if needs_sinks and name == "flash":
        raise ValueError(
            "attention_backend=flash cannot serve this model: it has attention sinks (gpt-oss), "
            "which flash attention does not support; use triton, torch or auto"
        )
    if name == "torch":
        return TorchPagedAttention()
    if name in ("flash", "triton"):
        backend, why = _load(name, device)
        if backend is None:
            raise RuntimeError(f"attention_backend={name} was asked for but cannot be used: {why}")
        logger.info("attention backend: %s (%s)", name, why)
        return backend
    if device.type != "cuda":
        logger.info("attention backend: torch (flash not used: flash attention needs CUDA; "
                    "triton not used: the triton kernel needs CUDA; device is %s)", device.type)
        return TorchPagedAttention()
    reasons = [f"flash not used: {no_flash}"] if needs_sinks else []
    for candidate in ("triton",) if needs_sinks else ("flash", "triton"):
        backend, why = _load(candidate, device)
        if backend is not None:
            suffix = f"; {'; '.join(reasons)}" if reasons else ""
            logger.info("attention backend: %s (%s%s)", candidate, why, suffix)
            return backend
        reasons.append(f"{candidate} not used: {why}")
    logger.info("attention backend: torch (%s)", "; ".join(reasons))
    return TorchPagedAttention()
