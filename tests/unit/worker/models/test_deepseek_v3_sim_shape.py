"""The simulator's DeepSeek-V3-class shape: its counts are the published model's, and its
KV bytes per token are what the engine's latent pool holds for the same config."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.models_mla import measure_pool
from worker.costs.shapes import SHAPES_DIR, load_shape


def test_deepseek_v3_shape_counts() -> None:
    shape = load_shape("deepseek-v3")
    assert shape.mla is not None and shape.moe is not None
    assert shape.num_params == pytest.approx(671e9, rel=0.005)  # DeepSeek-V3: 671B in all
    # ~37B activated per token, of which embedding + LM head are ~1.9B
    assert shape.matmul_params + 2 * shape.vocab_size * shape.hidden_size == pytest.approx(37.5e9, rel=0.02)
    assert shape.kv_bytes_per_token() == 61 * (512 + 64) * 2


def test_sim_kv_bytes_equal_the_engine_pool() -> None:
    from transformers import AutoConfig

    cfg = json.loads((SHAPES_DIR / "deepseek-v3.json").read_text())
    hf_config = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in cfg.items() if k != "model_type"})
    assert measure_pool(hf_config).bytes_per_token == load_shape("deepseek-v3").kv_bytes_per_token()
    assert torch.bfloat16.itemsize == load_shape("deepseek-v3").dtype_bytes


def test_dense_shapes_unchanged() -> None:
    shape = load_shape("llama-3-8b")
    assert shape.mla is None and shape.moe is None
    assert shape.num_params == 8_030_261_248
    assert shape.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
