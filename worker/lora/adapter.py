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
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes

from worker.api import LoRAAdapterError
from worker.lora.identity import (CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, read_bounded, read_adapter_files,
                                  split_ref)

# Each adapter file is at most this large unless the config says otherwise (LoRAConfig.max_adapter_bytes).
DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3

# PEFT target name -> the fused projection that holds it and its part index there.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """Full (unsharded) fp32 tensors per (layer, target): A (r, in) and B (out, r) with the
    scaling folded in. Targets the adapter does not touch are absent."""

    name: str
    path: str
    rank: int
    digest: str = ""  # SHA-256 of its files (worker/lora/identity.py)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def lora_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_config(path: Path | str, max_rank: int) -> dict:
    """adapter_config.json of a directory (or reference, worker/lora/identity.py), read
    bounded and checked for what this engine applies."""
    directory, _ = split_ref(str(path))
    file = Path(directory) / CONFIG_FILE
    return parse_config(read_bounded(file, MAX_CONFIG_BYTES, CONFIG_FILE), max_rank)


def parse_config(data: bytes, max_rank: int) -> dict:
    """adapter_config.json's bytes, checked; every error is a LoRAAdapterError (the load
    API's 400) that names no path."""
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise LoRAAdapterError(f"the adapter's {CONFIG_FILE} is not valid JSON") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"the adapter's {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {str(config.get('peft_type'))[:40]!r} is not LORA")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise LoRAAdapterError(f"rank r={str(r)[:20]}; this server takes ranks 1..{max_rank} (max_lora_rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAAdapterError("lora_alpha must be a finite number")
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
                   if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={str(config['bias'])[:20]!r}")
    if unsupported:
        raise LoRAAdapterError(f"unsupported adapter settings: {', '.join(unsupported)}")
    return config


def load_adapter(name: str, path: str | Path, layer_shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES) -> LoRAAdapter:
    """Read a PEFT adapter directory, or a reference with its digest (worker/lora/identity.py:
    the files must still have that digest). `layer_shapes[target]` = (in, out) of each
    target in the base model (full sizes). Raises LoRAAdapterError with the reason."""
    ref = str(path)
    # sizes checked before anything is read whole; the config before the weights are read
    files = read_adapter_files(ref, max_bytes, lambda data: parse_config(data, max_rank))
    config = parse_config(files.config, max_rank)
    scaling = lora_scaling(config)
    try:
        tensors = load_bytes(files.weights)
    except (SafetensorError, OSError, ValueError, RuntimeError):
        raise LoRAAdapterError(f"the adapter's {WEIGHTS_FILE} is not a readable safetensors file") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"unexpected tensor {key[:200]!r} (only LoRA A/B of decoder layers are applied)")
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in layer_shapes:
            supported = list(layer_shapes)
            raise LoRAAdapterError(f"target module {target!r} is not supported for this model ({', '.join(supported)})")
        if layer >= num_layers:
            raise LoRAAdapterError(f"layer {layer} does not exist (the model has {num_layers})")
        halves.setdefault((layer, target), {})[half] = tensor
    adapter = LoRAAdapter(name, ref, config["r"], digest=files.digest)
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"layer {layer} {target} has lora_A or lora_B missing")
        a, b = pair["A"], pair["B"]
        in_f, out_f = layer_shapes[target]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.shape != (r, in_f) or b.shape != (out_f, r) or r > max_rank:  # checked before any fp32 copy
            raise LoRAAdapterError(
                f"layer {layer} {target}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the model "
                f"(A (r, {in_f}), B ({out_f}, r), r <= {max_rank}): an adapter of another base model?")
        adapter.weights[(layer, target)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    if not adapter.weights:
        raise LoRAAdapterError("the adapter has no LoRA weights")
    return adapter
