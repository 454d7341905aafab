"""Config checks of the mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss):
what worker/model/moe_decoder.py cannot build is refused here, torch-free, so that
`kvserve serve` refuses it before Ray starts (called by model_config.check_supported)."""
from __future__ import annotations

from typing import Any

from worker.model_config import UnsupportedModelError

_GPT_OSS_LAYER_TYPES = {"sliding_attention", "full_attention"}


def num_experts_of(family: str, hf_config: Any) -> int:
    if family == "qwen3_moe":
        return int(getattr(hf_config, "num_experts", 0) or 0)
    return int(getattr(hf_config, "num_local_experts", 0) or 0)


def check_moe_config(family: str, hf_config: Any) -> None:
    num_experts = num_experts_of(family, hf_config)
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    if family != "qwen3_moe" and num_experts <= 0:
        raise UnsupportedModelError(f"a {family} config needs num_local_experts > 0 (got {num_experts})")
    if num_experts > 0 and not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})"
        )
    if family == "qwen3_moe":
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 0)
        if num_experts > 0 and step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step must be >= 1 (got {step})")
    if family == "gpt_oss":
        types = list(getattr(hf_config, "layer_types", None) or [])
        unknown = set(types) - _GPT_OSS_LAYER_TYPES
        if unknown:
            raise UnsupportedModelError(
                f"gpt-oss layer types {sorted(unknown)} are not supported; kvserve builds "
                f"{', '.join(sorted(_GPT_OSS_LAYER_TYPES))}"
            )
        if len(types) < hf_config.num_hidden_layers:
            raise UnsupportedModelError(
                f"gpt-oss layer_types names {len(types)} layers; the model has {hf_config.num_hidden_layers}"
            )
        if "sliding_attention" in types and not getattr(hf_config, "sliding_window", None):
            raise UnsupportedModelError("gpt-oss sliding_attention layers need a sliding_window")
