"""When the fused Triton kernels (worker/model/fused_kernels.py) replace the torch path,
and the per-op entry points the layers call.

Rule: the kernels run on CUDA tensors when Triton imports; everywhere else the torch path
runs (a CPU device computes the step itself, where launches cost nothing). Tests switch
them on for CPU tensors under Triton's interpreter (`set_fused_kernels(True)`), and a
device check can switch them off (`set_fused_kernels(False)`) to compare.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model import fused_kernels

_MODE: bool | None = None  # None: on CUDA only; True: on every device; False: never


def set_fused_kernels(mode: bool | None) -> None:
    """None: the default (CUDA only); True: every device (CPU under TRITON_INTERPRET=1);
    False: the torch path everywhere."""
    global _MODE
    _MODE = mode


def fused_on(x: torch.Tensor) -> bool:
    if fused_kernels.triton is None or _MODE is False:
        return False
    return _MODE is True or x.is_cuda


def silu_mul(gate_up: torch.Tensor, part: int) -> torch.Tensor:
    """silu(gate) * up of (T, 2 * part) rows [gate | up]."""
    if fused_on(gate_up) and gate_up.dim() == 2 and gate_up.shape[-1] == 2 * part:
        return fused_kernels.silu_mul(gate_up)
    gate, up = gate_up.split(part, dim=-1)
    return F.silu(gate) * up


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hkv, D) rotated by the step's cos / sin rows (T, D), already in
    q's dtype. The fused kernel rotates in place, so it runs only when the caller allows
    it (`inplace`: q and k are its own fresh projections)."""
    if inplace and fused_on(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0:
        fused_kernels.rope_qk_(q, k, cos, sin)
        return q, k
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, meta: object, backend: object) -> bool:
    """RoPE of q and k and the K/V write into the layer's paged cache, in one kernel, when
    the fused path runs and the backend can attend without writing (`attend`): one KV
    group, a contiguous cache of k's dtype (a quantised cache writes through its backend).
    True when done (the caller then calls `backend.attend`); False: nothing was done."""
    if not (fused_on(q) and hasattr(backend, "attend") and getattr(meta, "groups", None) is None):
        return False
    if kv_cache.dtype != k.dtype or not kv_cache.is_contiguous() or q.shape[-1] % 2:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    fused_kernels.rope_qk_(q, k, cos, sin, v, kv_cache, meta.slot_mapping)  # type: ignore[attr-defined]
    return True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
