"""AWQ, GEMM layout (AutoAWQ / the publishers' `version: gemm` files), 4 bits:

    <base>.qweight (in, out / 8) int32   <base>.qzeros (in / group, out / 8) int32
    <base>.scales  (in / group, out) float16
    W^T[i, o] = (q[i, o] - z[i // group, o]) * scales[i // group, o]

Eight output columns share a word in AutoAWQ's interleaved order: nibble k of a word
holds column 8 w + [0, 2, 4, 6, 1, 3, 5, 7][k] (zeros are packed the same way).
The weight returned is W (out, in), Hugging Face's nn.Linear layout.
"""
from __future__ import annotations

import torch

from worker.model.quant.layout import checked_scale, expect_dtype, expect_shape, unpack_last

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word is nibble AWQ_REVERSE_ORDER[j]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) words -> (R, 8 C) columns in their natural order."""
    nibbles = unpack_last(packed, 4).reshape(*packed.shape, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


class AWQFormat:
    marker = ".qweight"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (f"{base}.qweight", f"{base}.qzeros", f"{base}.scales"), ()

    def out_name(self, base: str) -> str:
        return f"{base}.weight"

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        qweight = tensors[f"{base}.qweight"]
        expect_dtype(f"{base}.qweight", qweight, (torch.int32,))
        cols_in, words = qweight.shape
        rows_out = words * 8
        group = self.group_size if self.group_size > 0 else cols_in
        groups = -(-cols_in // group)
        qzeros = tensors[f"{base}.qzeros"]
        expect_shape(f"{base}.qzeros", qzeros, (groups, words))
        scales = checked_scale(f"{base}.scales", tensors[f"{base}.scales"])
        expect_shape(f"{base}.scales", scales, (groups, rows_out))
        q = unpack_awq(qweight).float()
        z = unpack_awq(qzeros).float().repeat_interleave(group, dim=0)[:cols_in]
        s = scales.repeat_interleave(group, dim=0)[:cols_in]
        return ((q - z) * s).t().contiguous()
