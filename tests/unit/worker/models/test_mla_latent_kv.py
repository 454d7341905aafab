"""The latent KV kind of DeepSeek-V3's multi-head latent attention: what the pool holds per
token, the absorbed decode against the expanded form, the grouped gate against
transformers' router, latent blocks through a disaggregation export/import, and the
config switches that are refused."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kv.kv_cache import KVCacheSpec, num_blocks_for_budget
from tests.support.tiny_deepseek import VOCAB, DeepseekReference, deepseek_config
from worker.api import SamplingParams
from worker.attention.mla_paged import MLADims, attend_expanded, causal_mask, decode_absorbed, split_kv_b
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.model.deepseek_moe import RoutingArch, grouped_topk
from worker.model.deepseek_v3 import DeepseekV3Arch
from worker.model_config import UnsupportedModelError, check_supported
from worker.engine.build import build_engine

BLOCK = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeepseekReference]:
    yield DeepseekReference(tmp_path_factory.mktemp("tiny-deepseek-kv"))


def _config(model_dir: Path, **cache: object) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, **cache),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    )


# -- what the pool holds --------------------------------------------------------------------

def test_pool_bytes_per_token_are_the_latent_row(reference: DeepseekReference) -> None:
    """One row of kv_lora_rank + qk_rope_head_dim per token per layer, fp32: from the same
    byte budget the pool holds 2 * H * qk_head_dim / (R + rope) times the blocks that
    per-head K and V of the same attention would."""
    config = deepseek_config("ds_qlora")
    budget = 4 * 1024**2
    engine = build_engine(_config(reference.checkpoint("ds_qlora"), kv_cache_bytes=budget))
    runner = engine.runner
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    layers = config.num_hidden_layers
    assert runner.spec.bytes_per_block // BLOCK == latent * layers * 4
    assert tuple(runner.kv_caches.shape) == (layers, 1, runner.num_blocks, BLOCK, 1, latent)
    assert runner.num_blocks == budget // (latent * layers * 4 * BLOCK)

    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    per_head = KVCacheSpec(layers, config.num_attention_heads, qk_head_dim, BLOCK, torch.float32)
    assert runner.num_blocks // num_blocks_for_budget(per_head, budget) == (
        2 * config.num_attention_heads * qk_head_dim // latent
    )
    assert engine.stats().kv.total_blocks == runner.num_blocks


# -- the absorbed decode is the expanded attention ------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_absorbed_decode_equals_expanded(dtype: torch.dtype, tol: float) -> None:
    """Three sequences of different context lengths: each one's last query attends to its
    latent rows through W_UK / W_UV absorbed, and to K/V expanded by kv_b_proj; the
    outputs agree to rounding."""
    torch.manual_seed(0)
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20)
    kv_b = torch.nn.Linear(dims.kv_lora_rank, dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                           bias=False).to(dtype)
    lengths = [5, 37, 64]
    rows = torch.randn(len(lengths), max(lengths), dims.latent_dim, dtype=dtype)
    q_nope = torch.randn(len(lengths), dims.num_heads, dims.qk_nope_head_dim, dtype=dtype)
    q_pe = torch.randn(len(lengths), dims.num_heads, dims.qk_rope_head_dim, dtype=dtype)
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    scale = 0.17
    w_uk, w_uv = split_kv_b(kv_b.weight, dims)
    absorbed = decode_absorbed(q_nope, q_pe, rows, valid, w_uk, w_uv, scale)
    for i, n in enumerate(lengths):
        expanded = attend_expanded(q_nope[i : i + 1], q_pe[i : i + 1], rows[i, :n], kv_b, dims, scale,
                                   causal_mask(n, 1, rows.device))
        torch.testing.assert_close(absorbed[i : i + 1], expanded, rtol=tol, atol=tol)


# -- the gate -------------------------------------------------------------------------------

@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_grouped_topk_matches_transformers_router(n_group: int, topk_group: int, norm: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = deepseek_config("ds_qlora", n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=norm)
    torch.manual_seed(1)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.uniform_(-0.3, 0.3)
    hidden = torch.randn(50, config.hidden_size)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = grouped_topk(logits, router.e_score_correction_bias, RoutingArch.from_hf_config(config))
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(hf_weights.gather(1, hf_order), weights.gather(1, order))


# -- latent blocks through disaggregation ---------------------------------------------------

def test_latent_kv_export_import_continues_exactly(reference: DeepseekReference) -> None:
    """A prefill engine exports a prompt's latent blocks (one plane, one row per token);
    a decode engine imports them and continues: the tokens are transformers' own."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, VOCAB) for _ in range(41)]
    (expected,) = reference.greedy("ds_qlora", [prompt], [12])
    model_dir = reference.checkpoint("ds_qlora")
    prefill = build_engine(_config(model_dir, num_blocks_override=32))
    decode = build_engine(_config(model_dir, num_blocks_override=32))
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    (first,) = [out for out in prefill.step() if out.request_id == "r"]
    export = first.extra["kv_export"]
    config = deepseek_config("ds_qlora")
    assert export.num_planes == 1 and export.num_kv_heads == 1
    assert tuple(export.kv.shape) == (config.num_hidden_layers, 1, 3 * BLOCK, 1,
                                      config.kv_lora_rank + config.qk_rope_head_dim)
    decode.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0), kv_import=export)
    prefill.release_kv("r")
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == expected


# -- refused --------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (dict(topk_method="greedy"), "topk_method"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(n_routed_experts=6), "not divisible by n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(hidden_act="gelu"), "activation"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized"),
])
def test_config_switches_not_built_are_refused(overrides: dict, message: str) -> None:
    config = deepseek_config("ds_qlora", **overrides)
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(config)


def test_tensor_parallel_sizes_that_do_not_split_are_refused() -> None:
    DeepseekV3Arch.from_hf_config(deepseek_config("ds_qlora")).validate_tp(2)
    with pytest.raises(ValueError, match="attention heads 4"):
        DeepseekV3Arch.from_hf_config(deepseek_config("ds_qlora")).validate_tp(3)
    with pytest.raises(ValueError, match="moe_intermediate_size 30"):
        DeepseekV3Arch.from_hf_config(deepseek_config("ds_qlora", moe_intermediate_size=30)).validate_tp(4)
    with pytest.raises(ValueError, match="attention_bias"):
        DeepseekV3Arch.from_hf_config(deepseek_config("ds_flat")).validate_tp(2)


def test_engine_refuses_what_mla_does_not_run(reference: DeepseekReference) -> None:
    config = _config(reference.checkpoint("ds_qlora"), num_blocks_override=8)
    config = replace(config, model=replace(config.model, attention_backend="triton"))
    with pytest.raises(ValueError, match="attention_backend=triton"):
        build_engine(config)


def test_checkpoint_names() -> None:
    """Per-expert tensors load into the fused experts' parts, gate/up of the dense and
    shared MLPs into their fused projections, and multi-token-prediction layers (stored
    past num_hidden_layers) are not loaded."""
    from worker.model.deepseek_v3 import DeepseekV3ForCausalLM

    arch = DeepseekV3Arch.from_hf_config(deepseek_config("ds_qlora"))
    target = DeepseekV3ForCausalLM.checkpoint_target
    assert target("model.layers.2.mlp.experts.5.up_proj.weight", arch) == ("layers.2.mlp.experts", "w13", 11)
    assert target("model.layers.2.mlp.experts.5.down_proj.weight", arch) == ("layers.2.mlp.experts", "w2", 5)
    assert target("model.layers.0.mlp.up_proj.weight", arch) == ("layers.0.mlp.gate_up_proj", "weight", 1)
    assert target("model.layers.1.mlp.shared_experts.gate_proj.weight", arch) == (
        "layers.1.mlp.shared_experts.gate_up_proj", "weight", 0)
    assert target("model.layers.1.mlp.gate.e_score_correction_bias", arch) == (
        "layers.1.mlp.gate", "e_score_correction_bias", 0)
    assert target(f"model.layers.{arch.num_layers}.self_attn.kv_b_proj.weight", arch) is None
