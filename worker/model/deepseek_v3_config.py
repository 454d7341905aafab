"""What a DeepSeek-V3 config may ask of kvserve: everything else is refused here, before
any weight is read (torch-free, so `kvserve serve` refuses before Ray starts).

Built: MLA with q_lora_rank set or None, attention_bias, rope_interleave both ways,
default / linear / llama3 / yarn RoPE (with YaRN's mscale_all_dim in the softmax scale),
first_k_dense_replace dense layers then MoE layers, shared experts (0 or more), the
sigmoid gate with e_score_correction_bias, n_group / topk_group grouped top-k
("noaux_tc"), norm_topk_prob both ways, routed_scaling_factor, a tied or separate head.
"""
from __future__ import annotations

from typing import Any

from worker.api import UnsupportedModelError


def _refuse(what: str) -> None:
    raise UnsupportedModelError(f"DeepSeek-V3 config: {what}")


def check_deepseek_v3(hf_config: Any) -> None:
    """Raise UnsupportedModelError naming the first switch the model code does not build."""
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads")
    if kv_heads != heads:
        _refuse(f"num_key_value_heads={kv_heads} != num_attention_heads={heads}: MLA expands one "
                "latent to every query head; transformers' model needs them equal too")
    if get("kv_lora_rank") is None:
        _refuse("kv_lora_rank is required (the latent KV width)")
    if get("qk_rope_head_dim", 0) % 2:
        _refuse(f"qk_rope_head_dim={get('qk_rope_head_dim')} must be even (RoPE rotates pairs)")
    topk_method = get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        _refuse(f"topk_method={topk_method!r}; kvserve routes DeepSeek-V3's 'noaux_tc' (grouped top-k "
                "with e_score_correction_bias)")
    scoring = get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        _refuse(f"scoring_func={scoring!r}; kvserve's DeepSeek-V3 gate scores with a sigmoid")
    if get("moe_layer_freq", 1) != 1:
        _refuse(f"moe_layer_freq={get('moe_layer_freq')}; every layer from first_k_dense_replace on is MoE "
                "in transformers' DeepSeek-V3 (moe_layer_freq 1)")
    _check_routing(get)


def _check_routing(get: Any) -> None:
    num_experts, top_k = get("n_routed_experts"), get("num_experts_per_tok")
    if not num_experts or not top_k:
        _refuse("n_routed_experts and num_experts_per_tok are required")
    groups, topk_groups = get("n_group") or 1, get("topk_group") or 1
    if num_experts % groups:
        _refuse(f"n_routed_experts={num_experts} is not divisible by n_group={groups}")
    if num_experts // groups < 2:
        _refuse(f"n_group={groups} leaves fewer than 2 experts per group (a group scores by its 2 best)")
    if not 1 <= topk_groups <= groups:
        _refuse(f"topk_group={topk_groups} must be between 1 and n_group={groups}")
    if top_k > topk_groups * (num_experts // groups):
        _refuse(f"num_experts_per_tok={top_k} exceeds the experts of the topk_group={topk_groups} kept groups")
