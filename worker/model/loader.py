"""Load a Hugging Face model directory (config.json + *.safetensors), or a .gguf file,
into our model.

The model is built on the `meta` device (no memory, no random init), materialised empty
on the target device, then every tensor is copied once from safetensors into place.
The model class comes from the registry (worker/model/registry.py), and so does the
mapping of checkpoint names to its parameters (its `checkpoint_target`).
Fused projections receive the HF tensors into their row ranges:
    qkv_proj rows:     [0, q) <- q_proj   [q, q+kv) <- k_proj   [q+kv, q+2kv) <- v_proj
    gate_up_proj rows: [0, I) <- gate_proj  [I, 2I) <- up_proj
Under tensor parallelism q, kv, I are this rank's local sizes and each rank reads only
its rows (column-parallel) or cols (row-parallel) of each tensor (worker/model/parallel.py).
A module with its own layout (the experts of worker/model/moe.py) reads its pieces itself
through `load_checkpoint_tensor` and says how many parts a parameter has (`num_load_parts`).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.attention.base import AttentionBackend
from worker.model.checkpoint_names import ALL_PARTS
from worker.model.layers import RotaryEmbedding
from worker.model.registry import model_class_for
from worker.model_config import is_gguf
from worker.model.parallel import (
    SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPContext, VocabParallelEmbedding,
)
from worker.model.gguf_checkpoint import GGUFCheckpoint
from worker.model.quant.checkpoint import QuantizedCheckpoint
from worker.model.quant.fp8_linear import keep_fp8_weights
from worker.model.quant.int4_linear import INT4_METHODS, keep_int4_weights
from worker.model.quant.spec import quant_spec

logger = logging.getLogger(__name__)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / f for f in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


@dataclass
class LoadStats:
    """What loading materialised on this rank (a TP rank must read only its shard)."""

    num_tensors: int = 0
    num_bytes: int = 0


def load_model(
    path: Path,
    hf_config: object,
    backend: AttentionBackend,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPContext = SINGLE,
    keep_quantized: bool | None = None,
) -> torch.nn.Module:
    """Build the model for rank `tp.rank` and fill it from safetensors. Each sharded tensor
    is read through `get_slice` for just this rank's rows / cols (never the whole tensor);
    `model.load_stats` records what was read. Quantized projections stay quantized
    (`keep_quantized`; None: on CUDA): compressed-tensors FP8 in FP8 (worker/model/quant/
    fp8_linear.py), 4-bit AWQ / GPTQ / W4A16 packed (int4_linear.py)."""
    cls = model_class_for(hf_config)
    arch = cls.arch_from_hf_config(hf_config)
    with torch.device("meta"):
        model = cls(arch, hf_config, backend, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    quant = getattr(hf_config, "quantization_config", None)
    model.kept_quantized = None  # the format whose projections stay quantized, if any
    if quant is not None and (device.type == "cuda" if keep_quantized is None else keep_quantized):
        model.kept_quantized = _keep_quantized(model, quant_spec(quant))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    stats = LoadStats()
    for f in _checkpoints(path, arch, getattr(hf_config, "quantization_config", None)):
        for name in f.keys():
            target = cls.checkpoint_target(name, arch)
            if target is None:
                continue
            module_name, kind, part = target
            module = model.get_submodule(module_name)
            dest = params[f"{module_name}.{kind}"]
            if hasattr(module, "load_checkpoint_tensor"):
                with torch.no_grad():
                    tensor = module.load_checkpoint_tensor(f, name, kind, part, dest)
            else:
                tensor = _read_shard(f, name, module, kind, part, dest)
            stats.num_tensors += 1
            stats.num_bytes += tensor.numel() * tensor.element_size()
            parts = range(_num_parts(module, kind)) if part == ALL_PARTS else (part,)
            loaded.update(f"{module_name}.{kind}@{p}" for p in parts)
    _check_complete(model, params, loaded)
    model.load_stats = stats
    model.eval()
    return model


def _keep_quantized(model: torch.nn.Module, spec: Any) -> str | None:
    """Projections that stay quantized on the device (the other formats are dequantized);
    returns the format kept, None when dequantized."""
    if spec.method == "ct_fp8":
        keep_fp8_weights(model)
        return spec.method
    if spec.method in INT4_METHODS and spec.bits == 4:
        keep_int4_weights(model, spec.group_size)
        return spec.method
    return None


def _checkpoints(path: Path, arch: Any, quantization_config: Any = None) -> Iterator[Any]:
    """The checkpoint's tensor files, each open in turn, behind safetensors' reader
    interface (keys / get_slice / get_tensor): the .safetensors files of a directory,
    one .gguf file (dequantized, HF names: worker/model/gguf_checkpoint.py), or a
    quantized directory's files all at once (dequantized: worker/model/quant/)."""
    if is_gguf(path):
        yield GGUFCheckpoint(path, arch.num_heads, arch.num_kv_heads)
        return
    if quantization_config is not None:
        with QuantizedCheckpoint(safetensors_files(path), quantization_config) as f:
            yield f
        return
    for file in safetensors_files(path):
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            yield f


def _read_shard(
    f: object, name: str, module: torch.nn.Module, kind: str, part: int, dest: torch.nn.Parameter
) -> torch.Tensor:
    """Read this rank's piece of checkpoint tensor `name` and copy it into `dest`."""
    with torch.no_grad():
        if isinstance(module, ColumnParallelLinear):
            lo, hi = module.part_ranges[part]
            tensor = f.get_slice(name)[lo:hi]
            offset = module.part_offsets[part]
            dest[offset : offset + hi - lo].copy_(tensor)
        elif isinstance(module, RowParallelLinear) and kind == "weight":
            lo, hi = module.col_range
            tensor = f.get_slice(name)[:, lo:hi]
            dest.copy_(tensor)
        elif isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
            lo, hi = module.row_range
            tensor = f.get_slice(name)[lo:hi]
            dest[: hi - lo].copy_(tensor)
            dest[hi - lo :].zero_()  # pad rows of the last shard
        else:  # replicated (norms)
            tensor = f.get_tensor(name)
            dest.copy_(tensor)
    return tensor


def _num_parts(module: torch.nn.Module, kind: str) -> int:
    """How many checkpoint pieces fill parameter `kind` of `module`."""
    if hasattr(module, "num_load_parts"):
        return module.num_load_parts(kind)
    return len(module.part_ranges) if isinstance(module, ColumnParallelLinear) else 1


def _check_complete(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        module_name, _, _ = name.rpartition(".")
        num_parts = _num_parts(model.get_submodule(module_name), name.rpartition(".")[2])
        missing += [f"{name}@{p}" for p in range(num_parts) if f"{name}@{p}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
