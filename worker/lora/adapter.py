"""A PEFT LoRA adapter read into host memory: adapter_config.json + adapter_model.safetensors.

PEFT's layer computes   y = W x + (B A x) * scaling,   A: (r, in), B: (out, r),
scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA. Here the scaling is folded
into B once at load, so applying an adapter is two matmuls.

Checkpoint names (PEFT's save_pretrained):
    base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_<A|B>.weight
The loader checks every shape against the model, so a wrong adapter fails at load with
a message naming what is wrong, never in a step.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.api import LoRAAdapterError

# PEFT target name -> the fused projection that holds it and its part index there.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """Full (unsharded) fp32 tensors per (layer, target): A (r, in) and B (out, r) with the
    scaling folded in. Targets the adapter does not touch are absent."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def lora_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_config(path: Path, max_rank: int) -> dict:
    """adapter_config.json, checked for what this engine applies."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"{path} is not a PEFT LoRA adapter: no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise LoRAAdapterError(f"{file} is not valid JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    r = config.get("r")
    if not isinstance(r, int) or not 1 <= r <= max_rank:
        raise LoRAAdapterError(f"{path}: rank r={r!r}; this server takes ranks 1..{max_rank} (max_lora_rank)")
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
                   if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise LoRAAdapterError(f"{path}: unsupported adapter settings: {', '.join(unsupported)}")
    return config


def load_adapter(name: str, path: str | Path, layer_shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter directory. `layer_shapes[target]` = (in, out) of each target in
    the base model (full sizes). Raises LoRAAdapterError with the reason."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path, max_rank)
    scaling = lora_scaling(config)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"{path}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"{file} is not a readable safetensors file: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{path}: unexpected tensor {key!r} (only LoRA A/B of decoder layers are applied)")
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS or target not in layer_shapes:
            supported = [t for t in TARGETS if t in layer_shapes]
            raise LoRAAdapterError(
                f"{path}: target module {target!r} is not supported for this model ({', '.join(supported)})")
        if layer >= num_layers:
            raise LoRAAdapterError(f"{path}: layer {layer} does not exist (the model has {num_layers})")
        halves.setdefault((layer, target), {})[half] = tensor
    adapter = LoRAAdapter(name, str(path), config["r"])
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{path}: layer {layer} {target} has lora_A or lora_B missing")
        a, b = pair["A"].float(), pair["B"].float()
        in_f, out_f = layer_shapes[target]
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r) or r > max_rank:
            raise LoRAAdapterError(
                f"{path}: layer {layer} {target}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the model "
                f"(A (r, {in_f}), B ({out_f}, r), r <= {max_rank}): an adapter of another base model?")
        adapter.weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    if not adapter.weights:
        raise LoRAAdapterError(f"{path}: the adapter has no LoRA weights")
    return adapter
