"""FP8 with block scales (quant_method fp8: DeepSeek-V3's own files, Qwen3-*-FP8):

    <base>.weight            (out, in) float8_e4m3fn
    <base>.weight_scale_inv  (ceil(out / bo), ceil(in / bi)) float32
    W[r, c] = weight[r, c] * weight_scale_inv[r // bo, c // bi]

(`_inv` is the publishers' name: the tensor multiplies, it is the inverse of the quantizer's scale.)
"""
from __future__ import annotations

import torch

from worker.model.quant.layout import checked_scale, expect_dtype, expect_shape


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A (ceil(rows / bo), ceil(cols / bi)) grid of scales -> one scale per element."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


class FP8BlockFormat:
    marker = ".weight_scale_inv"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (f"{base}.weight", f"{base}.weight_scale_inv"), ()

    def out_name(self, base: str) -> str:
        return f"{base}.weight"

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = tensors[f"{base}.weight"]
        expect_dtype(f"{base}.weight", weight, (torch.float8_e4m3fn,))
        rows, cols = weight.shape
        bo, bi = self.block
        name = f"{base}.weight_scale_inv"
        scale = checked_scale(name, tensors[name])
        expect_shape(name, scale, (-(-rows // bo), -(-cols // bi)))
        return weight.float() * expand_blocks(scale, rows, cols, self.block)
