"""The cost model on mixture-of-experts and latent-attention shapes, against hand-computed
counts: a step reads the experts its tokens route to (top_k at one token, every expert
in a big batch) and pays half a tile of padded rows per touched expert; latent attention
prices decode pairs in the latent space and prefill pairs expanded, with kv_b_proj's
rebuild of the chunk's context."""
from __future__ import annotations

from dataclasses import replace

import pytest

from worker.costs.cost_model import COMPONENTS, StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shape_parts import moe_tile_rows
from worker.costs.shapes import ModelShape, load_shape

# hidden 64, 2 layers, 8 experts of intermediate 32, top-2, no shared experts, no dense layer
MOE = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, max_position_embeddings=512, torch_dtype="bfloat16")
# 4 heads, R = 32, rope 16, nope 32, v 24, q straight from the hidden state
MLA = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
           qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=512, torch_dtype="bfloat16")


def _model(cfg: dict) -> StepCostModel:
    return StepCostModel(ModelShape.from_hf_config(cfg), load_profile("h200"))


def _part(model: StepCostModel, rows: list[tuple[int, int, bool]], name: str) -> tuple[float, float]:
    f = model.rows_features(rows)
    i = COMPONENTS.index(name)
    return f.flops[i], f.bytes[i]


def test_expected_touched_experts() -> None:
    moe = ModelShape.from_hf_config(MOE).moe
    assert moe is not None
    assert moe.expected_touched_experts(0) == 0
    assert moe.expected_touched_experts(1) == pytest.approx(2)
    assert moe.expected_touched_experts(2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert moe.expected_touched_experts(1000) == pytest.approx(8)
    assert moe_tile_rows(16 * 8, 8) == 16 and moe_tile_rows(16 * 8 + 1, 8) == 64


def test_moe_step_reads_the_experts_its_tokens_touch() -> None:
    model = _model(MOE)
    shape = model.shape
    expert_bytes = 3 * 64 * 32 * 2
    always = (shape.matmul_params - 2 * 2 * 3 * 64 * 32) * 2  # every weight but the active routed experts
    act = model._dense_act_bytes_per_token
    for num_tokens, touched, tile in ((1, 2.0, 16), (2, 3.5, 16), (1000, 8.0, 64)):
        flops, bytes_ = _part(model, [(1, 10, True)] * num_tokens, "dense")
        assert bytes_ == pytest.approx(always + 2 * touched * expert_bytes + act * num_tokens, rel=1e-6)
        padding = 2 * (3 * 64 * 32) * (2 * touched * tile / 2)
        assert flops == pytest.approx(2 * shape.matmul_params * num_tokens + padding, rel=1e-6)


def test_qwen3_30b_a3b_shape_and_its_big_batch_decode() -> None:
    """The published Qwen3-30B-A3B: ~30.5B weights, ~3.3B active per token. A decode step
    of 256 rows touches nearly all 128 experts of every layer, so it reads nearly all the
    weights: far more than its active count says, and far more than one row reads."""
    shape = load_shape("qwen3-30b-a3b")
    assert shape.num_params == pytest.approx(30.5e9, rel=0.01)
    assert shape.matmul_params == pytest.approx(3.3e9 - 2 * 151936 * 2048, rel=0.05)
    model = StepCostModel(shape, load_profile("h200"))
    _, b1 = _part(model, [(1, 1000, True)], "dense")
    _, b256 = _part(model, [(1, 1000, True)] * 256, "dense")
    expert_bytes = 48 * 128 * 3 * 2048 * 768 * 2
    assert b256 > 0.99 * expert_bytes and b1 < 0.1 * expert_bytes


def test_mla_attention_prices_latent_decode_and_expanded_prefill() -> None:
    model = _model(MLA)
    layers, heads, d = 3, 4, 2
    latent = 32 + 16
    # one decode at context 99: 100 pairs, 100 latent rows read + 1 written
    flops, bytes_ = _part(model, [(1, 99, True)], "decode_attention")
    assert flops == (2 * heads * latent + 2 * heads * 32) * layers * 100
    assert bytes_ == latent * layers * d * 101 + heads * (latent + 32) * layers * d
    # one prefill chunk of 10 after 20 cached: 10*20 + 55 pairs; kv_b_proj over 30 context tokens
    flops, bytes_ = _part(model, [(10, 20, True)], "prefill_attention")
    pairs = 10 * 20 + 55
    assert flops == (2 * heads * (32 + 16) + 2 * heads * 24) * layers * pairs + 2 * 32 * heads * (32 + 24) * layers * 30
    expanded = 2 * heads * (32 + 16 + 24) * layers * d * 30
    assert bytes_ == latent * layers * d * (30 + 10) + heads * (32 + 16 + 24) * layers * d * 10 + expanded


def test_gqa_attention_unchanged() -> None:
    """A dense GQA shape keeps the per-head formula: 4 * heads * head_dim per pair per layer."""
    shape = load_shape("llama-3-8b")
    model = StepCostModel(shape, load_profile("h200"))
    flops, _ = _part(model, [(1, 99, True)], "decode_attention")
    assert flops == 4 * 32 * 128 * 32 * 100
    flops, _ = _part(model, [(10, 20, True)], "prefill_attention")
    assert flops == 4 * 32 * 128 * 32 * (10 * 20 + 55)
    assert replace(shape).moe is None
