"""compressed-tensors (RedHatAI / llm-compressor) weights:

float-quantized FP8 (W8A8-FP8):
    <base>.weight        (out, in) float8_e4m3fn
    <base>.weight_scale  (1,) / () per tensor, (out, 1) per channel, float
    <base>.input_scale   static activation scale (optional; activations are quantized
                         only on the CUDA FP8 path, where it is dynamic per token)
    W = weight * weight_scale

pack-quantized W4A16 (symmetric int4):
    <base>.weight_packed (out, in / 8) int32: input column j at bits 4 (j % 8) of word j // 8,
                         stored as q + 8 (q in [-8, 7])
    <base>.weight_scale  (out, in / group) float (channel: (out, 1))
    <base>.weight_shape  (2,) int: [out, in]
    W[r, c] = (unpacked[r, c] - 8) * weight_scale[r, c // group]
"""
from __future__ import annotations

import torch

from worker.model.quant.layout import CorruptCheckpointError, checked_scale, expect_dtype, expect_shape, unpack_last


class CompressedFP8Format:
    marker = ".weight_scale"

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (f"{base}.weight", f"{base}.weight_scale"), (f"{base}.input_scale",)

    def out_name(self, base: str) -> str:
        return f"{base}.weight"

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = tensors[f"{base}.weight"]
        expect_dtype(f"{base}.weight", weight, (torch.float8_e4m3fn,))
        name = f"{base}.weight_scale"
        scale = checked_scale(name, tensors[name])
        rows = weight.shape[0]
        if scale.numel() == 1:
            scale = scale.reshape(1, 1)
        else:
            expect_shape(name, scale, (rows, 1))
        return weight.float() * scale


class PackedInt4Format:
    marker = ".weight_packed"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"), ()

    def out_name(self, base: str) -> str:
        return f"{base}.weight"

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        shape = tensors[f"{base}.weight_shape"]
        if shape.numel() != 2:
            raise CorruptCheckpointError(f"quantized checkpoint tensor {base}.weight_shape: {shape.tolist()}, not [out, in]")
        rows, cols = (int(v) for v in shape.tolist())
        packed = tensors[f"{base}.weight_packed"]
        expect_dtype(f"{base}.weight_packed", packed, (torch.int32,))
        expect_shape(f"{base}.weight_packed", packed, (rows, -(-cols // 8)))
        values = unpack_last(packed, 4)[:, :cols].float() - 8.0
        group = self.group_size or cols
        name = f"{base}.weight_scale"
        scale = checked_scale(name, tensors[name])
        expect_shape(name, scale, (rows, -(-cols // group)))
        return values * scale.repeat_interleave(group, dim=1)[:, :cols]
