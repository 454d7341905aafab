"""How an expert turns its gate and up halves into the down projection's input: shared by
the torch grouped experts (worker/model/moe.py) and the Triton kernel (moe_triton.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEActivation:
    """How an expert turns its gate and up halves into the down projection's input.
    "silu": silu(gate) * up (Qwen3-MoE, Mixtral, DeepSeek). "swiglu_clamp" (gpt-oss):
    gate clamped to <= limit, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


SILU = MoEActivation()


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    if activation.kind == "silu":
        return F.silu(gate) * up
    if activation.kind == "swiglu_clamp":
        gate = gate.clamp(min=None, max=activation.limit)
        up = up.clamp(min=-activation.limit, max=activation.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
    raise ValueError(f"unknown MoE activation {activation.kind!r}")
