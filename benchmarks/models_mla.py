"""KV bytes per token the pool holds: a DeepSeek-V3-class MLA model against an equal GQA one.

    python -m benchmarks.models_mla

Shapes (the published DeepSeek-V3 attention geometry, bf16):

    MLA  61 layers, 128 query heads, kv_lora_rank 512, qk_rope_head_dim 64,
         qk_nope_head_dim 128, v_head_dim 128
    GQA  the same 61 layers and 128 query heads of head_dim 128, with 8 KV heads (the
         group size of Llama-3-70B / 405B)

Measured: each config goes through the engine's own path (the model class from the
registry parses it, worker/model/kv_geometry.py gives the pool's KVCacheSpec, and
kv.kv_cache.allocate_kv_cache builds the pool tensor, on the `meta` device so no memory
is taken); bytes per token = the pool tensor's bytes / (blocks * block_size). The blocks
each pool gets from one budget are counted with num_blocks_for_budget, as the runner does.

Expected, from the geometry: (kv_lora_rank + qk_rope_head_dim) / (2 * kv_heads * head_dim)
= 576 / 2048 = 0.28125 (the latent pool holds 3.56x the tokens of the GQA pool).

RESULT mla_kv_bytes_vs_gqa=<measured> expected=<geometry> mla_blocks_vs_gqa=<from one budget>
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kv.kv_cache import allocate_kv_cache, num_blocks_for_budget
from worker.model.kv_geometry import kv_cache_spec_for
from worker.model.registry import arch_for

BLOCK_SIZE = 16
BUDGET_BYTES = 64 * 1024**3  # an H100-class KV budget
DTYPE = torch.bfloat16
NUM_LAYERS, NUM_HEADS = 61, 128
KV_LORA_RANK, QK_ROPE_HEAD_DIM, QK_NOPE_HEAD_DIM, V_HEAD_DIM = 512, 64, 128, 128
GQA_KV_HEADS, GQA_HEAD_DIM = 8, 128


def deepseek_v3_class_config() -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "deepseek_v3", num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS, kv_lora_rank=KV_LORA_RANK, q_lora_rank=1536,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM, qk_nope_head_dim=QK_NOPE_HEAD_DIM, v_head_dim=V_HEAD_DIM,
        hidden_size=7168, architectures=["DeepseekV3ForCausalLM"],
    )


def equal_gqa_config() -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama", num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=GQA_KV_HEADS,
        head_dim=GQA_HEAD_DIM, hidden_size=7168, architectures=["LlamaForCausalLM"],
    )


@dataclass(frozen=True)
class PoolGeometry:
    bytes_per_token: int
    num_blocks: int  # from BUDGET_BYTES


def measure_pool(hf_config: Any) -> PoolGeometry:
    spec = kv_cache_spec_for(arch_for(hf_config), BLOCK_SIZE, DTYPE)
    num_blocks = num_blocks_for_budget(spec, BUDGET_BYTES)
    pool = allocate_kv_cache(spec, num_blocks, torch.device("meta"))
    return PoolGeometry(pool.numel() * pool.element_size() // (num_blocks * BLOCK_SIZE), num_blocks)


def expected_ratio() -> float:
    return (KV_LORA_RANK + QK_ROPE_HEAD_DIM) / (2 * GQA_KV_HEADS * GQA_HEAD_DIM)


def mla_kv_bytes_vs_gqa() -> dict[str, float]:
    """The measured ratio of KV bytes per token (MLA / GQA), the expected one from the
    geometry, each side's bytes per token and the ratio of blocks one budget buys."""
    mla, gqa = measure_pool(deepseek_v3_class_config()), measure_pool(equal_gqa_config())
    return {
        "mla_kv_bytes_vs_gqa": mla.bytes_per_token / gqa.bytes_per_token,
        "expected": expected_ratio(),
        "mla_bytes_per_token": mla.bytes_per_token,
        "gqa_bytes_per_token": gqa.bytes_per_token,
        "mla_blocks_vs_gqa": mla.num_blocks / gqa.num_blocks,
    }


def main() -> None:
    r = mla_kv_bytes_vs_gqa()
    print(f"MLA (DeepSeek-V3 class) {r['mla_bytes_per_token']:,} B/token; "
          f"GQA ({GQA_KV_HEADS} KV heads x {GQA_HEAD_DIM}) {r['gqa_bytes_per_token']:,} B/token "
          f"({NUM_LAYERS} layers, {DTYPE})")
    print(f"RESULT mla_kv_bytes_vs_gqa={r['mla_kv_bytes_vs_gqa']:.5f} expected={r['expected']:.5f} "
          f"mla_blocks_vs_gqa={r['mla_blocks_vs_gqa']:.3f}")


if __name__ == "__main__":
    main()
