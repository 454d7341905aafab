"""The decode roofline arithmetic of benchmarks/gpu.py (benchmarks/roofline.py)."""
from __future__ import annotations

import pytest

from benchmarks.roofline import ModelShape, decode_floor_s, decode_step_bytes, roofline_pct

# Llama-3-8B: 8,030,261,248 parameters; embedding 128256 x 4096 (untied LM head).
LLAMA3_8B = ModelShape(num_params=8_030_261_248, embedding_params=128256 * 4096, hidden_size=4096,
                       num_layers=32, num_kv_heads=8, head_dim=128)


def test_step_bytes_are_weights_plus_kv() -> None:
    weights = (8_030_261_248 - 128256 * 4096) * 2
    assert decode_step_bytes(LLAMA3_8B, 1, 0) == weights + 4096 * 2
    kv_per_token = 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert decode_step_bytes(LLAMA3_8B, 256, 1024) - decode_step_bytes(LLAMA3_8B, 256, 0) == 256 * 1024 * kv_per_token


def test_floor_and_percentage() -> None:
    floor = decode_floor_s(LLAMA3_8B, 256, 1024, 4.8e12)
    assert floor == pytest.approx((15_009_849_344 + 256 * 4096 * 2 + 34_359_738_368) / 4.8e12)
    best = 256 / floor
    assert roofline_pct(best / 2, LLAMA3_8B, 256, 1024, 4.8e12) == pytest.approx(50.0)
    # batch 1: the weights dominate, ~3.1 ms per token at 4.8 TB/s
    assert decode_floor_s(LLAMA3_8B, 1, 1024, 4.8e12) == pytest.approx(3.15e-3, rel=0.01)
