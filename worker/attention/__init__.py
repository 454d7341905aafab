"""Attention backends: `torch` (default, everywhere) and `flash` (CUDA, when it loads)."""
from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillInfo
from worker.attention.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeGroup", "PrefillInfo", "select_backend"]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` takes flash when it loads on this device, torch otherwise; `flash` insists."""
    if name not in ("auto", "torch", "flash"):
        raise ValueError(f"unknown attention backend {name!r} (auto, torch, flash)")
    if name == "torch":
        return TorchPagedAttention()
    from worker.attention.flash import load_flash_backend

    backend, why = load_flash_backend(device)
    if backend is not None:
        logger.info("attention backend: flash (%s)", why)
        return backend
    if name == "flash":
        raise RuntimeError(f"attention_backend=flash was asked for but cannot be used: {why}")
    logger.info("attention backend: torch (flash not used: %s)", why)
    return TorchPagedAttention()
