"""LoRA on a loaded model: wrap its projections (worker/lora/layers.py), write adapters
into device slots, and say the full shapes an adapter must have (worker/lora/adapter.py)."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from worker.lora.adapter import DEFAULT_MAX_ADAPTER_BYTES, TARGETS, LoRAAdapter, load_adapter
from worker.lora.cost import target_shapes as lora_target_shapes
from worker.lora.layers import LoRAColumnLinear, LoRARowLinear, LoRAStepState
from worker.model.llama import LlamaArch

# Where each fused projection lives in a decoder layer.
_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


# The attention projections: the targets every family takes (MoE families take only these).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def target_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target in the full (unsharded) model. A model with sparse MoE
    layers (worker/model/moe_decoder.py) takes adapters on its attention projections only:
    its experts are not Linear modules PEFT can target."""
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


class ModelLoRA:
    """The model's wrapped projections and their shared step state."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.state = LoRAStepState(max_loras, max_rank)
        self.layers: list[dict[str, LoRAColumnLinear | LoRARowLinear]] = []
        attention_only = any(getattr(model.arch, "moe_layers", ()))  # see target_shapes
        owners = {p: o for p, o in _OWNER.items() if o == "self_attn" or not attention_only}
        for layer in model.layers:
            wrapped = {}
            for proj, owner in owners.items():
                parent = getattr(layer, owner)
                base = getattr(parent, proj)
                cls = LoRAColumnLinear if proj in ("qkv_proj", "gate_up_proj") else LoRARowLinear
                wrapped[proj] = cls(base, self.state)
                setattr(parent, proj, wrapped[proj])
            self.layers.append(wrapped)

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` into `slot` of every projection (targets it lacks become zeros)."""
        for i, wrapped in enumerate(self.layers):
            for module in wrapped.values():
                module.clear_slot(slot)
            for target, (proj, part) in TARGETS.items():
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
