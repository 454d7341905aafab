"""What a LoRA adapter costs a device, torch-free: its bytes (from adapter_config.json and
the base model's dimensions), the time to copy them into a device slot, and the work
its rows add to a step. The simulated device (worker/sim/lora.py) and the discrete-event
simulator (cluster/sim/) price adapters with these functions, so both agree with each
other and with what the runner does (worker/lora/layers.py).

    bytes(adapter) = sum over layers and targets t of  r * (in_t + out_t) * dtype_bytes
    load_seconds   = bytes / link_bytes_per_s                      (host -> device copy)
    per step with k slots in use (slots are handed out lowest first), T tokens in the
    flat batch and R = max_lora_rank, every wrapped part p of every layer computes
        shrink  x @ A_p[:k*R]^T   2 * T * k*R * in_p   FLOPs, k*R*in_p   weights read
        expand  xa @ B_p[:k*R]    2 * T * k*R * out_p  FLOPs, k*R*out_p  weights read
    (every row pays every active slot's columns: the masked matmul pair)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The PEFT targets the runner applies (worker/lora/adapter.py's TARGETS maps each to the
# fused projection and part that holds it; a unit test keeps the two lists equal).
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_shapes(hidden_size: int, intermediate_size: int, q_size: int, kv_size: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target in the full (unsharded) model; q_size = heads *
    head_dim, kv_size = kv_heads * head_dim."""
    h, i = hidden_size, intermediate_size
    return {"q_proj": (h, q_size), "k_proj": (h, kv_size), "v_proj": (h, kv_size), "o_proj": (q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def config_targets(config: dict) -> tuple[str, ...]:
    """The targets an adapter_config.json names, as PEFT reads `target_modules`: a list of
    module names, "all-linear", or one regular expression matched against module paths."""
    modules = config.get("target_modules")
    if modules == "all-linear":
        return TARGET_NAMES
    if isinstance(modules, str):
        return tuple(t for t in TARGET_NAMES if re.fullmatch(modules, f"model.layers.0.self_attn.{t}")
                     or re.fullmatch(modules, f"model.layers.0.mlp.{t}") or re.fullmatch(modules, t))
    return tuple(t for t in TARGET_NAMES if t in set(modules or ()))


def adapter_num_bytes(rank: int, targets: tuple[str, ...], shapes: dict[str, tuple[int, int]], num_layers: int,
                      dtype_bytes: int) -> int:
    """Bytes of an adapter's A and B over all layers, in the serving dtype."""
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    return per_layer * num_layers * dtype_bytes


def config_num_bytes(config: dict, shapes: dict[str, tuple[int, int]], num_layers: int, dtype_bytes: int) -> int:
    """adapter_num_bytes of an adapter_config.json's rank `r` and targets."""
    return adapter_num_bytes(int(config["r"]), config_targets(config), shapes, num_layers, dtype_bytes)


def load_seconds(num_bytes: int, link_bytes_per_s: float) -> float:
    """Seconds to copy an adapter's bytes into a device slot over the host link."""
    if link_bytes_per_s <= 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    return num_bytes / link_bytes_per_s


@dataclass(frozen=True)
class LoRAStepWork:
    """The FLOPs and weight bytes the adapter rows add to one step (0 when no row uses one)."""

    flops: float
    bytes: float


def step_work(num_tokens: int, num_active_slots: int, max_rank: int, shapes: dict[str, tuple[int, int]],
              num_layers: int, dtype_bytes: int) -> LoRAStepWork:
    """The masked shrink/expand pair of every target of every layer (module docstring)."""
    if num_active_slots <= 0 or num_tokens <= 0:
        return LoRAStepWork(0.0, 0.0)
    columns = num_active_slots * max_rank
    widths = sum(shapes[t][0] + shapes[t][1] for t in TARGET_NAMES) * num_layers
    return LoRAStepWork(2.0 * num_tokens * columns * widths, float(columns * widths * dtype_bytes))
