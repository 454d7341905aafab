"""A quantized safetensors checkpoint as the loader reads one (keys / get_tensor /
get_slice), in dequantized Hugging Face names: worker/model/loader.py copies what this
returns into the model, exactly as it copies an unquantized file's tensors.

Every file of the checkpoint is open at once: a weight and its scales may sit in
different shards. Each quantized weight (a base whose `marker` tensor exists) is
dequantized on request into float32 (its parts read whole: a TP rank slices the result).
A tensor no format consumed is passed through, and must then be a float tensor: an int or
FP8 tensor left over is a weight whose scales are missing, and is refused by name.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.model.quant.awq import AWQFormat
from worker.model.quant.compressed_tensors import CompressedFP8Format, PackedInt4Format
from worker.model.quant.fp8_block import FP8BlockFormat
from worker.model.quant.gptq import GPTQFormat
from worker.model.quant.int4_linear import INT4_METHODS, int4_parts
from worker.model.quant.layout import CorruptCheckpointError, QuantFormat
from worker.model.quant.mxfp4 import MXFP4Format
from worker.model.quant.spec import QuantSpec, quant_spec


def format_for(spec: QuantSpec) -> QuantFormat:
    formats: dict[str, Any] = {
        "fp8": lambda: FP8BlockFormat(spec.block),
        "ct_fp8": CompressedFP8Format,
        "ct_w4a16": lambda: PackedInt4Format(spec.group_size),
        "awq": lambda: AWQFormat(spec.group_size),
        "gptq": lambda: GPTQFormat(spec.bits, spec.group_size, spec.desc_act),
        "mxfp4": MXFP4Format,
    }
    return formats[spec.method]()


class QuantizedCheckpoint:
    """The dequantized view of a quantized checkpoint's safetensors files (a context manager:
    the files stay open while it is)."""

    def __init__(self, files: list[Path], quantization_config: Any) -> None:
        self.spec = quant_spec(quantization_config)
        self.format = format_for(self.spec)
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(os.fspath(file), framework="pt", device="cpu"))
            self._where.update({name: handle for name in handle.keys()})
        self._quantized = self._plan()

    def __enter__(self) -> QuantizedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _plan(self) -> dict[str, str]:
        """Dequantized name -> its base; checks every quantized weight has its parts."""
        marker = self.format.marker
        quantized: dict[str, str] = {}
        consumed: set[str] = set()
        for name in self._where:
            if not name.endswith(marker):
                continue
            base = name[: -len(marker)]
            required, optional = self.format.parts(base)
            missing = [p for p in required if p not in self._where]
            if missing:
                raise CorruptCheckpointError(f"quantized weight {base} lacks tensors {missing}")
            quantized[self.format.out_name(base)] = base
            consumed.update(required + optional)
        self._passthrough = [n for n in self._where if n not in consumed]
        required, optional = self.format.parts("")
        companions = [p for p in required + optional if p and p != self.format.out_name("") and p != marker]
        for name in self._passthrough:
            orphan = next((p for p in companions if name.endswith(p)), None)
            if orphan is not None:
                base = name[: -len(orphan)]
                raise CorruptCheckpointError(f"quantized weight {base} has {name} but lacks {base}{marker}")
        return quantized

    def keys(self) -> list[str]:
        return self._passthrough + list(self._quantized)

    def get_tensor(self, name: str) -> torch.Tensor:
        base = self._quantized.get(name)
        if base is None:
            tensor = self._where[name].get_tensor(name)
            if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
                raise CorruptCheckpointError(
                    f"checkpoint tensor {name} is {tensor.dtype} but has no scales this "
                    f"{self.spec.method} checkpoint's format pairs with it"
                )
            return tensor
        required, optional = self.format.parts(base)
        tensors = {p: self._where[p].get_tensor(p) for p in required + optional if p in self._where}
        return self.format.dequantize(base, tensors)

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)

    def fp8_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressed-tensors FP8 weight as stored, (N, K) e4m3, with one float32 scale per
        row (a per-tensor scale repeated): worker/model/quant/fp8_linear.py keeps it in FP8."""
        base = self._quantized.get(name)
        if self.spec.method != "ct_fp8" or base is None:
            raise CorruptCheckpointError(f"{name} is not a per-tensor / per-channel FP8 weight of this checkpoint")
        required, _ = self.format.parts(base)
        tensors = {p: self._where[p].get_tensor(p) for p in required}
        self.format.dequantize(base, tensors)  # the same checks as the dequantized load
        q, scale = tensors[f"{base}.weight"], tensors[f"{base}.weight_scale"].float()
        return q, scale.reshape(-1).expand(q.shape[0]).contiguous() if scale.numel() == 1 else scale.reshape(-1)

    def int4_weight(self, name: str) -> tuple[torch.Tensor, ...]:
        """An int4 weight (AWQ, GPTQ 4-bit, W4A16) as the int4 GEMM reads it:
        worker/model/quant/int4_linear.py's int4_parts."""
        base = self._quantized.get(name)
        if self.spec.method not in INT4_METHODS or self.spec.bits != 4 or base is None:
            raise CorruptCheckpointError(f"{name} is not a 4-bit integer weight of this checkpoint")
        required, optional = self.format.parts(base)
        tensors = {p: self._where[p].get_tensor(p) for p in required + optional if p in self._where}
        self.format.dequantize(base, tensors)  # the same checks as the dequantized load
        return int4_parts(self.spec, base, tensors)

    def weight_bytes(self) -> int:
        """The bytes the checkpoint's files hold for its tensors (quantized as stored)."""
        total = 0
        for name, handle in self._where.items():
            piece = handle.get_slice(name)
            shape = piece.get_shape()
            numel = 1
            for d in shape:
                numel *= d
            total += numel * _itemsize(piece.get_dtype())
        return total


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)
