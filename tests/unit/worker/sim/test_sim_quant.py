"""The simulator's shapes and cost model take the weight and KV dtypes: a quantized
checkpoint's config prices its projections at their stored bytes, an FP8 KV cache halves
the bytes per token, and a simulated replica's KV pool grows by what the weights no longer
take (worker/costs/quant_bytes.py, worker/costs/shapes.py, worker/sim/runner.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cluster.cli import build_parser
from cluster.sim.cli import config_from_args
from cluster.sim.setup import SimDevice
from worker.config import CacheConfig, SchedulerConfig
from worker.costs.cost_model import SeqWork, StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import SHAPES_DIR, ModelShape, load_shape
from worker.sim.build import build_sim_engine

FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _shape(quant: dict | None) -> ModelShape:
    cfg = json.loads((SHAPES_DIR / "llama-3-8b.json").read_text())
    if quant is not None:
        cfg["quantization_config"] = quant
    return ModelShape.from_hf_config(cfg, "llama-3-8b")


def test_quantized_configs_price_projections_at_their_stored_bytes() -> None:
    bf16, fp8, awq = _shape(None), _shape(FP8_BLOCK), _shape(AWQ)
    assert bf16.projection_bytes == 2 and fp8.projection_bytes == pytest.approx(1 + 4 / 128**2)
    assert awq.projection_bytes == pytest.approx(0.5 + 4 / 128)
    # Embedding and LM head (2 x 128256 x 4096 in bf16) stay; the projections shrink.
    unquantized = 2 * 2 * bf16.vocab_size * bf16.hidden_size
    assert fp8.weight_bytes == pytest.approx(unquantized + (bf16.weight_bytes - unquantized) / 2, rel=1e-3)
    assert awq.weight_bytes < fp8.weight_bytes < bf16.weight_bytes
    # A decode step reads the weights: the FP8 model's is cheaper on the same device.
    h200 = load_profile("h200")
    decode = [SeqWork(1, 512, True)] * 8
    assert StepCostModel(fp8, h200).step_time_s(decode) < StepCostModel(bf16, h200).step_time_s(decode)


def test_fp8_kv_halves_bytes_per_token_and_doubles_the_sim_pool() -> None:
    shape = _shape(None)
    fp8_kv = replace(shape, kv_dtype_bytes=1)
    assert fp8_kv.kv_bytes_per_token() * 2 == shape.kv_bytes_per_token()
    assert fp8_kv.kv_block_bytes(16) * 2 == shape.kv_block_bytes(16)
    auto = build_sim_engine(shape, "h200", SchedulerConfig(), CacheConfig())
    fp8 = build_sim_engine(shape, "h200", SchedulerConfig(), CacheConfig(kv_cache_dtype="fp8"))
    assert fp8.runner.kv_bytes_per_block * 2 == auto.runner.kv_bytes_per_block
    assert fp8.runner.num_blocks == pytest.approx(2 * auto.runner.num_blocks, abs=1)
    # Long decodes read half the KV bytes: a KV-bound step is faster.
    long = [SeqWork(1, 32000, True)] * 64
    assert fp8.runner.cost.step_time_s(long) < auto.runner.cost.step_time_s(long)


def test_fp8_weights_leave_their_bytes_to_the_kv_pool() -> None:
    auto = build_sim_engine(_shape(None), "h100", SchedulerConfig(), CacheConfig())
    fp8 = build_sim_engine(_shape(FP8_BLOCK), "h100", SchedulerConfig(), CacheConfig())
    freed = _shape(None).weight_bytes - _shape(FP8_BLOCK).weight_bytes
    assert (fp8.runner.num_blocks - auto.runner.num_blocks) == pytest.approx(
        freed / auto.runner.kv_bytes_per_block, abs=1)
    assert load_shape("llama-3-8b").weight_dtype_bytes is None


def test_the_capacity_simulator_plans_fp8_kv_fleets() -> None:
    """`kvserve simulate --kv-cache-dtype fp8`: each simulated replica holds twice the blocks."""
    devices = {}
    for kv in ("auto", "fp8"):
        config = config_from_args(build_parser().parse_args(["simulate", "--kv-cache-dtype", kv]))
        assert config.kv_cache_dtype == kv
        devices[kv] = SimDevice.from_config(config)
    assert devices["fp8"].kv_bytes_per_token * 2 == devices["auto"].kv_bytes_per_token
    assert devices["fp8"].num_blocks == pytest.approx(2 * devices["auto"].num_blocks, abs=1)
