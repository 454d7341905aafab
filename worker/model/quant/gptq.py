"""GPTQ (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), 4 or 8 bits:

    <base>.qweight (in * bits / 32, out) int32: input row i at bits b (i % (32/b)) of word row i // (32/b)
    <base>.qzeros  (groups, out * bits / 32) int32, packed along out, stored as zero - 1
    <base>.scales  (groups, out) float16
    <base>.g_idx   (in,) int32: the group of each input row (desc_act on: the groups follow
                   the activation order, so g_idx is not i // group; absent: i // group)
    W^T[i, o] = (q[i, o] - (z[g_idx[i], o] + 1)) * scales[g_idx[i], o]
"""
from __future__ import annotations

import torch

from worker.model.quant.layout import CorruptCheckpointError, checked_scale, expect_dtype, expect_shape, unpack_last


class GPTQFormat:
    marker = ".qweight"

    def __init__(self, bits: int, group_size: int, desc_act: bool) -> None:
        self.bits, self.group_size, self.desc_act = bits, group_size, desc_act

    def parts(self, base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        required = (f"{base}.qweight", f"{base}.qzeros", f"{base}.scales")
        g_idx = (f"{base}.g_idx",)
        return (required + g_idx, ()) if self.desc_act else (required, g_idx)

    def out_name(self, base: str) -> str:
        return f"{base}.weight"

    def dequantize(self, base: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        per = 32 // self.bits
        qweight = tensors[f"{base}.qweight"]
        expect_dtype(f"{base}.qweight", qweight, (torch.int32,))
        cols_in, rows_out = qweight.shape[0] * per, qweight.shape[1]
        group = self.group_size if self.group_size > 0 else cols_in
        groups = -(-cols_in // group)
        scales = checked_scale(f"{base}.scales", tensors[f"{base}.scales"])
        expect_shape(f"{base}.scales", scales, (groups, rows_out))
        qzeros = tensors[f"{base}.qzeros"]
        expect_shape(f"{base}.qzeros", qzeros, (groups, rows_out // per))
        g_idx = tensors.get(f"{base}.g_idx")
        if g_idx is None:
            g_idx = torch.arange(cols_in) // group
        expect_shape(f"{base}.g_idx", g_idx, (cols_in,))
        g_idx = g_idx.long()
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise CorruptCheckpointError(f"quantized checkpoint tensor {base}.g_idx: groups outside [0, {groups})")
        q = unpack_last(qweight.t().contiguous(), self.bits).t().float()  # (in, out)
        z = unpack_last(qzeros, self.bits).float() + 1.0  # (groups, out)
        return ((q - z[g_idx]) * scales[g_idx]).t().contiguous()
