"""What of a Gemma 3 text config (model_type gemma3_text) kvserve builds, checked before
any weight loads; torch-free, as worker/model_config.py is (it calls check_gemma3).

Built (worker/model/gemma3.py): local sliding-window and global layers (`layer_types`, from
`sliding_window_pattern` when a config has no list), each kind with its own RoPE
(`rope_parameters[layer_type]`: rope_local_base_freq for local layers), query_pre_attn_scalar,
q/k norms, the gelu_pytorch_tanh MLP, final_logit_softcapping. Refused: attention logit
softcapping (Gemma 2's, not built), attention biases, bidirectional attention, other activations, RoPE types
outside worker/model_config.SUPPORTED_ROPE_TYPES.
"""
from __future__ import annotations

from typing import Any

from worker.api import UnsupportedModelError

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATION = "gelu_pytorch_tanh"


def _unsupported(message: str) -> Exception:
    return UnsupportedModelError(f"Gemma 3: {message}")


def gemma3_layer_types(hf_config: Any) -> list[str]:
    """Each layer's type, as transformers' Gemma3TextConfig fills it (its own list, or
    every `sliding_window_pattern`-th layer global)."""
    num_layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types[:num_layers])
    pattern = int(getattr(hf_config, "sliding_window_pattern", 6) or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def gemma3_rope_parameters(hf_config: Any, layer_type: str) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    own = params.get(layer_type)
    if own is None:
        raise _unsupported(f"the config has no rope_parameters for {layer_type!r} layers")
    return dict(own)


def check_gemma3(hf_config: Any, supported_rope_types: tuple[str, ...]) -> None:
    """UnsupportedModelError for a Gemma 3 switch the model code does not build
    (`supported_rope_types`: model_config's, passed in so that it need not be imported)."""
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act != ACTIVATION:
        raise _unsupported(f"unsupported activation {act!r}; Gemma 3 uses {ACTIVATION}")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise _unsupported("attn_logit_softcapping is not supported (the attention kernels do not cap "
                           "logits); Gemma 3 checkpoints leave it null")
    if getattr(hf_config, "attention_bias", False):
        raise _unsupported("attention_bias is not supported (Gemma 3 checkpoints have no attention biases)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise _unsupported("use_bidirectional_attention (an encoder use) is not supported; kvserve "
                           "serves causal generation")
    types = gemma3_layer_types(hf_config)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise _unsupported(f"unsupported layer types {unknown}; supported: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in types and not getattr(hf_config, "sliding_window", None):
        raise _unsupported("sliding_attention layers need `sliding_window`")
    for layer_type in sorted(set(types)):
        rope_type = gemma3_rope_parameters(hf_config, layer_type).get("rope_type", "default")
        if rope_type not in supported_rope_types:
            raise _unsupported(f"unsupported RoPE type {rope_type!r} on {layer_type} layers; "
                               f"supported: {', '.join(supported_rope_types)}")
