"""What every format module shares: the interface a format implements, shape and scale
checks that turn a corrupt file into a clear error at load, and int packing helpers.

A format names the tensors of one quantized weight by a common `base`
("model.layers.0.self_attn.q_proj"): `marker` is the suffix that says a base is quantized,
`parts(base)` the tensors its dequantization reads (required, optional), and
`dequantize(base, tensors)` returns the weight as float32 in Hugging Face's layout under
`out_name(base)`.
"""
from __future__ import annotations

from typing import Protocol

import torch


class CorruptCheckpointError(ValueError):
    """A quantized tensor whose shape, dtype or values contradict its format."""


class QuantFormat(Protocol):
    marker: str

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]: ...

    def out_name(self, base: str) -> str: ...

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor: ...


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CorruptCheckpointError(
            f"quantized checkpoint tensor {name}: shape {tuple(tensor.shape)}, its format needs {tuple(shape)}"
        )


def expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        raise CorruptCheckpointError(
            f"quantized checkpoint tensor {name}: dtype {tensor.dtype}, its format needs one of {list(dtypes)}"
        )


def checked_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """The scale as float32; every entry must be finite (a NaN/inf scale poisons its block)."""
    if not scale.is_floating_point():
        raise CorruptCheckpointError(f"quantized checkpoint tensor {name}: scales must be floats, got {scale.dtype}")
    out = scale.float()
    if not torch.isfinite(out).all():
        raise CorruptCheckpointError(f"quantized checkpoint tensor {name}: non-finite scale values")
    return out


def unpack_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words (..., C) -> unsigned values (..., C * 32 / bits); value k of a word sits at
    bits k*bits .. k*bits + bits - 1 (the low bits first)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of unpack_last (for tests and benchmarks that write checkpoints)."""
    per = 32 // bits
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // per, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (grouped << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
