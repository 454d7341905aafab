"""MXFP4 (OCP microscaling FP4; gpt-oss's expert weights), as transformers dequantizes it:

    <base>_blocks (E, rows, cols / 32, 16) uint8: two e2m1 values a byte, the low nibble first
    <base>_scales (E, rows, cols / 32) uint8: a shared power of two, exponent bias 127
    W[e, r, c] = FP4[nibble] * 2 ** (scales[e, r, c // 32] - 127)

The result is returned transposed, (E, cols, rows): Hugging Face's unquantized gpt-oss
names `mlp.experts.gate_up_proj` (E, H, 2I) and `mlp.experts.down_proj` (E, I, H), which
the expert loader (worker/model/moe.py) already reads.
"""
from __future__ import annotations

import torch

from worker.model.quant.layout import expect_dtype, expect_shape

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 blocks, (..., G) uint8 exponents -> (..., G * 32) float32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], 32)
    out = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


class MXFP4Format:
    marker = "_blocks"

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (f"{base}_blocks", f"{base}_scales"), ()

    def out_name(self, base: str) -> str:
        return base

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        blocks, scales = tensors[f"{base}_blocks"], tensors[f"{base}_scales"]
        expect_dtype(f"{base}_blocks", blocks, (torch.uint8,))
        expect_dtype(f"{base}_scales", scales, (torch.uint8,))
        if blocks.dim() != 4 or blocks.shape[-1] != 16:
            expect_shape(f"{base}_blocks", blocks, (*blocks.shape[:3], 16))
        expect_shape(f"{base}_scales", scales, tuple(blocks.shape[:-1]))
        return dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
