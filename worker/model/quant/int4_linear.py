"""int4 weights kept packed on the device (AWQ, GPTQ, compressed-tensors W4A16 on CUDA):
each projection of the decoder layers holds its weight in the int4 GEMM's layout
(worker/model/quant/int4_gemm.py) and multiplies with the dequantizing Triton kernel.

    weight (the parameter)  (K / 8, N) int32, packed along K (GPTQ's packing)
    scales, zeros           (G, N) float32, zeros unpacked (GPTQ's stored zero + 1, AWQ's
                            zero, 8 for symmetric compressed-tensors)
    perm                    (K,) long or None: GPTQ with desc_act orders its groups by
                            activation; the rows are stored sorted by group (row j in
                            group j // group) and x's columns are gathered by `perm`

Each format's tensors are turned into this one layout at load (`int4_parts`). Off CUDA the
product is int4_gemm_torch's (the tests force this path on CPU). Under tensor parallelism a
column-parallel projection takes its output columns; a row-parallel one its input rows,
which must fall on group boundaries (desc_act under row parallelism is refused).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from worker.model.parallel import ColumnParallelLinear, RowParallelLinear, all_reduce
from worker.model.quant.awq import unpack_awq
from worker.model.quant.int4_gemm import int4_gemm, int4_gemm_torch, pack_k_major
from worker.model.quant.kept import convert_projections
from worker.model.quant.layout import CorruptCheckpointError, unpack_last
from worker.model.quant.spec import QuantSpec

INT4_METHODS = ("awq", "gptq", "ct_w4a16")


def int4_parts(spec: QuantSpec, base: str, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(q (K, N) values in [0, 16), scales (G, N), zeros (G, N), g_idx (K,)) of one weight."""
    if spec.method == "gptq":
        q = unpack_last(t[f"{base}.qweight"].t().contiguous(), 4).t()
        zeros = unpack_last(t[f"{base}.qzeros"], 4).float() + 1.0
        scales = t[f"{base}.scales"].float()
        g_idx = t.get(f"{base}.g_idx")
        g_idx = torch.arange(q.shape[0]) // spec.group_size if g_idx is None else g_idx.long()
    elif spec.method == "awq":
        q, zeros = unpack_awq(t[f"{base}.qweight"]), unpack_awq(t[f"{base}.qzeros"]).float()
        scales = t[f"{base}.scales"].float()
        g_idx = torch.arange(q.shape[0]) // spec.group_size
    else:  # compressed-tensors W4A16, symmetric: q + 8 stored, packed along K per output row
        rows, cols = (int(v) for v in t[f"{base}.weight_shape"].tolist())
        q = unpack_last(t[f"{base}.weight_packed"], 4)[:, :cols].t()
        scales = t[f"{base}.weight_scale"].float().t()
        zeros = torch.full_like(scales, 8.0)
        g_idx = torch.arange(cols) // (spec.group_size or cols)
    return q.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx


def sorted_by_group(q: torch.Tensor, g_idx: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of q in group order, and the permutation (None when already in order)."""
    if torch.equal(g_idx, torch.arange(len(g_idx)) // group):
        return q, None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(len(g_idx)) // group):
        raise CorruptCheckpointError(f"g_idx does not put {group} input channels in each group")
    return q[perm], perm


class _Int4Weights:
    weight: nn.Parameter
    group: int
    perm: torch.Tensor | None
    perm_loaded: bool  # the first part of a fused projection set `perm`; the others must agree

    def load_checkpoint_tensor(self, f: object, name: str, kind: str, part: int, dest: torch.Tensor) -> torch.Tensor:
        column = isinstance(self, ColumnParallelLinear)
        if kind != "weight":  # a bias: dense
            tensor = f.get_tensor(name)
            if column:
                lo, hi = self.part_ranges[part]
                dest[self.part_offsets[part] : self.part_offsets[part] + hi - lo].copy_(tensor[lo:hi])
            else:
                dest.copy_(tensor)
            return tensor
        q, scales, zeros, g_idx = f.int4_weight(name)
        q, perm = sorted_by_group(q, g_idx, self.group)
        if self.perm_loaded and not _same_perm(perm, self.perm):
            raise CorruptCheckpointError(f"{name}: the g_idx of the parts of one fused projection differ")
        if column:
            lo, hi = self.part_ranges[part]
            cols = slice(self.part_offsets[part], self.part_offsets[part] + hi - lo)
            self.weight.data[:, cols].copy_(pack_k_major(q[:, lo:hi]))
            self.scales[:, cols].copy_(scales[:, lo:hi])
            self.zeros[:, cols].copy_(zeros[:, lo:hi])
        else:
            lo, hi = self.col_range
            if perm is not None and (lo, hi) != (0, q.shape[0]):
                raise CorruptCheckpointError(f"{name}: desc_act (g_idx) under row-parallel sharding is not built")
            if lo % self.group:
                raise CorruptCheckpointError(f"{name}: a shard starting at input {lo} splits a group of {self.group}")
            self.weight.data.copy_(pack_k_major(q[lo:hi]))
            self.scales.copy_(scales[lo // self.group : -(-hi // self.group)])
            self.zeros.copy_(zeros[lo // self.group : -(-hi // self.group)])
        self.perm, self.perm_loaded = perm, True
        return q

    def int4_matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x2 = x2[:, self.perm.to(x.device)]
        gemm = int4_gemm if x.is_cuda else int4_gemm_torch
        out = gemm(x2.contiguous(), self.weight, self.scales, self.zeros, self.group)
        return out.reshape(*shape[:-1], out.shape[-1])


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


class Int4ColumnParallelLinear(_Int4Weights, ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.int4_matmul(x)
        return out if self.bias is None else out + self.bias


class Int4RowParallelLinear(_Int4Weights, RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.int4_matmul(x), self.tp)
        return out if self.bias is None else out + self.bias


def keep_int4_weights(model: nn.Module, group_size: int) -> int:
    """Turn every projection of the decoder layers into its int4 form, empty, before loading."""
    return convert_projections(model, "Int4", Int4ColumnParallelLinear, Int4RowParallelLinear, _Int4Weights,
                               partial(_empty_int4, group_size=group_size))


def _empty_int4(module: nn.Module, group_size: int) -> None:
    n, k = module.weight.shape
    group = group_size or k
    device = module.weight.device
    module.group = group
    module.perm, module.perm_loaded = None, False
    module.weight = nn.Parameter(torch.empty(k // 8, n, dtype=torch.int32, device=device), requires_grad=False)
    module.register_buffer("scales", torch.empty(-(-k // group), n, dtype=torch.float32, device=device))
    module.register_buffer("zeros", torch.empty(-(-k // group), n, dtype=torch.float32, device=device))
