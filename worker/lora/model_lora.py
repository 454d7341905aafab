"""LoRA on a loaded model: wrap its projections (worker/lora/layers.py), write adapters
into device slots, and say the full shapes an adapter must have (worker/lora/adapter.py).

The targets per family:
    dense          q, k, v, o (fused qkv_proj) and gate, up, down (fused gate_up_proj)
    sparse MoE     q, k, v, o only (experts are not Linear modules PEFT can target)
    MLA            q_proj (or q_a_proj and q_b_proj), kv_a_proj_with_mqa, o_proj, each a
                   module of its own. kv_b_proj is no target: decode folds it into the
                   query and the output (worker/attention/mla_paged.py), so a delta on it
                   would need its own absorbed copy per adapter. A delta on
                   kv_a_proj_with_mqa changes the latent rows written to the pool, which
                   is sound because an adapter's blocks hash under its own root."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from worker.lora.adapter import DEFAULT_MAX_ADAPTER_BYTES, TARGETS, LoRAAdapter, load_adapter
from worker.lora.cost import target_shapes as lora_target_shapes
from worker.lora.layers import LoRAColumnLinear, LoRAReplicatedLinear, LoRARowLinear, LoRAStepState
from worker.model.kv_geometry import is_latent
from worker.model.llama import LlamaArch
from worker.model.parallel import ColumnParallelLinear, RowParallelLinear

# Where each fused projection lives in a decoder layer.
_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


# The attention projections: the targets every family takes (MoE families take only these).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _mla_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    m = arch.mla
    q_out, hidden = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.hidden_size
    shapes = {"kv_a_proj_with_mqa": (hidden, m.kv_lora_rank + m.qk_rope_head_dim),
              "o_proj": (m.num_heads * m.v_head_dim, hidden)}
    if m.q_lora_rank is None:
        shapes["q_proj"] = (hidden, q_out)
    else:
        shapes.update(q_a_proj=(hidden, m.q_lora_rank), q_b_proj=(m.q_lora_rank, q_out))
    return shapes


def projection_map(arch: Any) -> dict[str, tuple[str, int]]:
    """PEFT target -> (the projection module that holds it, its part there)."""
    if is_latent(arch):
        return {t: (t, 0) for t in _mla_shapes(arch)}
    return TARGETS


def target_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target in the full (unsharded) model (module docstring)."""
    if is_latent(arch):
        return _mla_shapes(arch)
    shapes = lora_target_shapes(arch.hidden_size, arch.intermediate_size, arch.num_heads * arch.head_dim,
                                arch.num_kv_heads * arch.head_dim)
    if any(getattr(arch, "moe_layers", ())):
        return {t: shapes[t] for t in ATTENTION_TARGETS}
    return shapes


def adapter_loader(arch: LlamaArch, max_rank: int, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES) -> partial[LoRAAdapter]:
    """(name, path) -> LoRAAdapter for this model (the registry's loader)."""
    return partial(_load, shapes=target_shapes(arch), num_layers=arch.num_layers, max_rank=max_rank,
                   max_bytes=max_bytes)


def _load(name: str, path: str, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
          max_bytes: int) -> LoRAAdapter:
    return load_adapter(name, path, shapes, num_layers, max_rank, max_bytes)


_Wrapped = LoRAColumnLinear | LoRARowLinear | LoRAReplicatedLinear


def _owners(arch: Any) -> dict[str, str]:
    """Projection module -> the layer attribute that holds it (module docstring)."""
    if is_latent(arch):
        return {proj: "self_attn" for proj, _ in projection_map(arch).values()}
    attention_only = any(getattr(arch, "moe_layers", ()))
    return {p: o for p, o in _OWNER.items() if o == "self_attn" or not attention_only}


def _wrap(base: nn.Module, state: LoRAStepState) -> _Wrapped:
    """The LoRA wrapper for how `base` is split over tensor-parallel ranks."""
    if isinstance(base, ColumnParallelLinear):
        return LoRAColumnLinear(base, state)
    if isinstance(base, RowParallelLinear):
        return LoRARowLinear(base, state)
    if isinstance(base, nn.Linear):
        return LoRAReplicatedLinear(base, state)
    raise TypeError(f"no LoRA wrapper for {type(base).__name__}")


class ModelLoRA:
    """The model's wrapped projections and their shared step state."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.state = LoRAStepState(max_loras, max_rank)
        self.targets = projection_map(model.arch)
        self.layers: list[dict[str, _Wrapped]] = []
        owners = _owners(model.arch)
        for layer in model.layers:
            wrapped: dict[str, _Wrapped] = {}
            for proj, owner in owners.items():
                parent = getattr(layer, owner)
                wrapped[proj] = _wrap(getattr(parent, proj), self.state)
                setattr(parent, proj, wrapped[proj])
            self.layers.append(wrapped)

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` into `slot` of every projection (targets it lacks become zeros)."""
        for i, wrapped in enumerate(self.layers):
            for module in wrapped.values():
                module.clear_slot(slot)
            for target, (proj, part) in self.targets.items():
                pair = adapter.weights.get((i, target))
                if pair is not None and proj in wrapped:
                    a, b = pair
                    dtype = wrapped[proj].weight.dtype
                    wrapped[proj].write(slot, part, a.to(dtype), b.to(dtype))

    def prepare(self, slots_per_row: list[int], lens: list[int], device: torch.device, dtype: torch.dtype) -> bool:
        """Set the step's row -> slot map from each sequence's slot (-1: base) and token
        count, in flat-batch order; returns whether any row uses an adapter."""
        top = max(slots_per_row, default=-1)
        if top < 0:
            self.state.prepare(None, 0, dtype)
            return False
        token_slots = torch.repeat_interleave(torch.tensor(slots_per_row, dtype=torch.long),
                                              torch.tensor(lens, dtype=torch.long))
        self.state.prepare(token_slots.to(device, non_blocking=True), top + 1, dtype)
        return True
