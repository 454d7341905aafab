"""Building blocks of the Llama family that carry no parallelism: RMSNorm and RoPE.
On CUDA they run as fused Triton kernels (worker/model/fused.py decides)."""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.model import fused, fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.fused_on(x):
            return fused_kernels.add_rms_norm(x, self.weight, self.eps)[0]
        # Same arithmetic as transformers (normalise in fp32, scale in the input dtype),
        # so greedy outputs match it token for token.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one fused kernel where this class's own
        arithmetic applies (a subclass with its own forward gets the torch path)."""
        if type(self).forward is RMSNorm.forward and fused.fused_on(x):
            return fused_kernels.add_rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total


class ScaleFirstRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: the weight scales the fp32 normalised values before the cast
    back to the input dtype (transformers also keeps these weights in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(dtype)


def rope_inv_freq(hf_config: object, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type (default,
    linear, llama3, yarn, ...), computed with transformers' own init functions."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling depends on the sequence length; not supported")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, built once (a gather per
    step instead of trigonometry per token)."""

    def __init__(self, hf_config: object, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self._hf_config, self._head_dim, self._max_positions = hf_config, head_dim, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute the tables in place, e.g. after the module was built on `meta`."""
        if self.cos.device.type == "meta":
            return
        inv_freq, scaling = self.inv_freq()
        positions = torch.arange(self._max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # fp32 tables whatever the model dtype: positions past 256 lose precision in bf16.
        self.cos = (emb.cos() * scaling).to(self.cos.device)
        self.sin = (emb.sin() * scaling).to(self.sin.device)

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and attention scaling (a family with per-layer RoPE overrides it)."""
        return rope_inv_freq(self._hf_config, self._head_dim)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inplace: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k rotated; `inplace`: the caller owns q and k (fresh projections), so the
        fused kernel may rotate them where they are."""
        # q: (T, Hq, D), k: (T, Hkv, D); rotate-half convention, as in transformers.
        cos, sin = self.tables(positions, q.dtype)
        return fused.rope_qk(q, k, cos, sin, inplace)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) cos / sin rows of `positions` in `dtype`: the step's, gathered once
        (begin_step), or gathered now for other positions."""
        step = self._step
        if step is not None and step[0] is positions and step[1].dtype == dtype:
            return step[1], step[2]
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    _step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin_step(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Gather this step's cos / sin rows once, in the model dtype, for every layer
        (until end_step); a layer called with other positions gathers its own."""
        self._step = (positions, self.cos[positions].to(dtype), self.sin[positions].to(dtype))

    def end_step(self) -> None:
        self._step = None
