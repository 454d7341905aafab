"""Bytes per weight of a quantized checkpoint's layer projections, from its
`quantization_config` (worker/model/quant/spec.py's formats), for the cost model and the
KV sizing of simulated devices (worker/costs/shapes.py):

    fp8 (block-scaled)            1 + 4 / (bo * bi)     one float32 scale per block
    compressed-tensors FP8        1                      (a scale per row or tensor: negligible)
    W4A16 / AWQ / GPTQ (int4)     0.5 + 4 / group        an fp16 scale and zero per group
    GPTQ 8-bit                    1 + 4 / group
    mxfp4 (gpt-oss)               0.5 + 1 / 32           one exponent byte per 32 values

The embedding, LM head and norms stay in the model dtype (publishers leave them
unquantized). For mxfp4 only the experts are quantized; the rate is applied to every layer
projection, which undercounts attention's bytes (a small share of a gpt-oss model's).
As on a CPU device, a simulated device's weights are priced as held: the CUDA path keeps
FP8 weights in FP8 (worker/model/quant/fp8_linear.py).
"""
from __future__ import annotations

from typing import Any

from worker.model.quant.spec import quant_spec


def quantized_weight_bytes(quantization_config: Any) -> float | None:
    """Bytes per layer-projection weight, or None for an unquantized config."""
    if not quantization_config:
        return None
    spec = quant_spec(quantization_config)
    if spec.method == "fp8":
        return 1.0 + 4.0 / (spec.block[0] * spec.block[1])
    if spec.method == "ct_fp8":
        return 1.0
    if spec.method == "mxfp4":
        return 0.5 + 1.0 / 32
    group = spec.group_size or 128
    return spec.bits / 8 + 4.0 / group
