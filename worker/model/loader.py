"""Load a Hugging Face model directory (config.json + *.safetensors) into our model.

The model is built on the `meta` device (no memory, no random init), materialised empty
on the target device, then every tensor is copied once from safetensors into place.
Fused projections receive the HF tensors into their row ranges:
    qkv_proj rows:     [0, q) <- q_proj   [q, q+kv) <- k_proj   [q+kv, q+2kv) <- v_proj
    gate_up_proj rows: [0, I) <- gate_proj  [I, 2I) <- up_proj
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from worker.attention.base import AttentionBackend
from worker.model.llama import LlamaArch, LlamaForCausalLM

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_model_path(model: str) -> Path:
    """A local directory as is; otherwise a Hub id, fetched when the machine is online."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {model!r} not found")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
        )
    except Exception as e:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a reachable Hugging Face Hub id ({e})"
        ) from e


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / f for f in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def load_model(
    path: Path,
    hf_config: object,
    backend: AttentionBackend,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    arch = LlamaArch.from_hf_config(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, hf_config, backend, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.rope.reset_tables()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _map_name(name, arch)
                if target is None:
                    continue
                dest_name, row_start = target
                dest = params[dest_name]
                tensor = f.get_tensor(name)
                with torch.no_grad():
                    dest[row_start : row_start + tensor.shape[0]].copy_(tensor)
                loaded.add(f"{dest_name}@{row_start}")
    _check_complete(params, loaded, arch)
    model.eval()
    return model


def _map_name(name: str, arch: LlamaArch) -> tuple[str, int] | None:
    """HF tensor name -> (our parameter name, first row it fills). None = not ours."""
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0
    if name == "model.norm.weight":
        return "norm.weight", 0
    if name == "lm_head.weight":
        return None if arch.tie_word_embeddings else ("lm_head.weight", 0)
    m = _LAYER.match(name)
    if m is None:
        return None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        dest, row = fused[module]
        return f"{prefix}{dest}.{kind}", row
    if "rotary_emb" in rest:
        return None
    return prefix + rest, 0


def _check_complete(params: dict[str, torch.nn.Parameter], loaded: set[str], arch: LlamaArch) -> None:
    missing = []
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q = arch.num_heads * arch.head_dim
            kv = arch.num_kv_heads * arch.head_dim
            parts = [0, q, q + kv]
        elif name.endswith("gate_up_proj.weight"):
            parts = [0, arch.intermediate_size]
        else:
            parts = [0]
        missing += [f"{name}@{p}" for p in parts if f"{name}@{p}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
