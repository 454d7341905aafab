"""The HBM roofline of a decode step: the bytes it must read, over the memory bandwidth.

A decode step of batch B at context length L reads every weight once (the embedding
table excepted: only the B looked-up rows) and the K/V of every cached token of every
sequence in every layer:

    weight_bytes = (num_params - embedding_params) * dtype_bytes + B * hidden * dtype_bytes
    kv_bytes     = B * L * num_layers * 2 * num_kv_heads * head_dim * kv_dtype_bytes
    floor_s      = (weight_bytes + kv_bytes) / bandwidth

so the best possible decode throughput is B / floor_s tokens/s, and a measured step
reaches floor_s / measured_s of it. Activations and logits (B x vocab) are ignored: at
decode they are tiny next to the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

H200_HBM_BYTES_PER_S = 4.8e12


@dataclass(frozen=True)
class ModelShape:
    num_params: int  # every parameter, embedding and LM head included
    embedding_params: int  # vocab * hidden of the input embedding (0 when tied to the LM head)
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16 weights
    kv_dtype_bytes: int = 2  # bf16 KV


def decode_step_bytes(shape: ModelShape, batch: int, context_len: int) -> int:
    weights = (shape.num_params - shape.embedding_params) * shape.dtype_bytes
    embedding_rows = batch * shape.hidden_size * shape.dtype_bytes
    kv = batch * context_len * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * shape.kv_dtype_bytes
    return weights + embedding_rows + kv


def decode_floor_s(shape: ModelShape, batch: int, context_len: int, bandwidth: float = H200_HBM_BYTES_PER_S) -> float:
    return decode_step_bytes(shape, batch, context_len) / bandwidth


def roofline_pct(tokens_per_s: float, shape: ModelShape, batch: int, context_len: int,
                 bandwidth: float = H200_HBM_BYTES_PER_S) -> float:
    """Measured decode tokens/s as a percentage of the roofline's B / floor_s."""
    best = batch / decode_floor_s(shape, batch, context_len, bandwidth)
    return 100.0 * tokens_per_s / best
