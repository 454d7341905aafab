"""FP8 weights kept in FP8 on the device (compressed-tensors W8A8-FP8 checkpoints on CUDA):
the projections of the decoder layers hold the checkpoint's e4m3 bytes and one float32
scale per output row, and multiply with torch._scaled_mm, as vLLM does on Hopper:

    x (T, K) -> per-token dynamic scale s_x[t] = amax(|x[t]|) / 448, x_q = x / s_x (e4m3)
    y[t, n]  = (x_q[t] . w_q[n]) * s_x[t] * s_w[n]      (fp32 accumulate, out in x's dtype)

A per-tensor weight scale is one value repeated over the rows of its part (q, k and v of a
fused projection keep their own). Block-scaled FP8 (quant_method fp8) varies its scale
along K too, which _scaled_mm's row-wise scaling cannot take: it is dequantized at load.
Off CUDA, `fp8_gemm` computes the same product by dequantizing (the tests' reference).
The weight bytes the device holds are then the FP8 bytes, which is what the KV budget,
measured after loading (kv/kv_cache.py gpu_kv_budget), sees as used.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.model.parallel import ColumnParallelLinear, RowParallelLinear, all_reduce
from worker.model.quant.kept import convert_projections

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) -> e4m3 (T, K) and the float32 scales (T, 1)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (weight (N, K) e4m3 * weight_scale (N,))^T with per-token FP8 activations."""
    shape = x.shape
    xq, xs = per_token_fp8(x.reshape(-1, shape[-1]))
    if x.is_cuda:
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.float().view(1, -1),
                               out_dtype=x.dtype)
    else:  # the same product, dequantized (fp32)
        out = ((xq.float() * xs) @ (weight.float() * weight_scale.float()[:, None]).t()).to(x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


class _FP8Weights:
    """What the FP8 projections share: the e4m3 weight, its row scales, and reading both
    from the checkpoint (QuantizedCheckpoint.fp8_weight) into this rank's rows / cols."""

    weight: nn.Parameter
    weight_scale: torch.Tensor

    def load_checkpoint_tensor(self, f: object, name: str, kind: str, part: int, dest: torch.Tensor) -> torch.Tensor:
        column = isinstance(self, ColumnParallelLinear)
        if kind != "weight":  # a bias: dense, as the unquantized loader reads it
            tensor = f.get_tensor(name)
            if column:
                lo, hi = self.part_ranges[part]
                offset = self.part_offsets[part]
                dest[offset : offset + hi - lo].copy_(tensor[lo:hi])
            else:
                dest.copy_(tensor)
            return tensor
        q, scale = f.fp8_weight(name)
        if column:
            lo, hi = self.part_ranges[part]
            offset = self.part_offsets[part]
            self.weight.data[offset : offset + hi - lo].copy_(q[lo:hi])
            self.weight_scale[offset : offset + hi - lo].copy_(scale[lo:hi])
            return q[lo:hi]
        lo, hi = self.col_range
        self.weight.data.copy_(q[:, lo:hi])
        self.weight_scale.copy_(scale)
        return q[:, lo:hi]


class FP8ColumnParallelLinear(_FP8Weights, ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_gemm(x, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias


class FP8RowParallelLinear(_FP8Weights, RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(fp8_gemm(x, self.weight, self.weight_scale), self.tp)
        return out if self.bias is None else out + self.bias


def keep_fp8_weights(model: nn.Module) -> int:
    """Turn every projection of the decoder layers into its FP8 form, empty, before loading
    (after the model's dtype cast, which would turn e4m3 parameters into the model dtype).
    Returns how many were converted."""
    return convert_projections(model, "FP8", FP8ColumnParallelLinear, FP8RowParallelLinear, _FP8Weights, _empty_fp8)


def _empty_fp8(module: nn.Module) -> None:
    rows, cols = module.weight.shape
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    module.register_buffer("weight_scale", torch.ones(rows, dtype=torch.float32, device=device))
