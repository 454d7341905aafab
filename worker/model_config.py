"""Reading a model's config (a Hugging Face directory or a single .gguf file): what it is,
whether kvserve can serve it exactly, its stop tokens and its tokenizer.

Torch-free, so that `kvserve serve` can refuse an unsupported checkpoint before Ray starts.
Everything the model code cannot honour is refused here with a message naming what is
supported; nothing in a config is silently ignored.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from worker.api import (  # noqa: F401
    GGUF_INSTALL_HINT, MissingDependencyError, UnsupportedModelError, is_gguf, load_tokenizer, require_gguf,
)
from worker.model.deepseek_v3_config import check_deepseek_v3
from worker.model.gemma3_config import check_gemma3
from worker.model.moe_checks import check_moe_config
from worker.model.quant.spec import check_quantization
from worker.model_path import is_hub_id, resolve_model_path

logger = logging.getLogger(__name__)

# HF architecture -> our family (worker/model/registry.py: family -> model class).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",  # text only (model_type gemma3_text): worker/model/gemma3.py
}
# Architectures refused with a reason of their own (what to serve instead).
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (vision tower + language model) is not "
    "supported; kvserve serves Gemma 3 text checkpoints (Gemma3ForCausalLM, model_type gemma3_text)",
}
# Families whose `sliding_window` applies to every layer (no per-layer types).
_EVERY_LAYER_WINDOW = ("mistral", "mixtral", "qwen3_moe")
# A config without `architectures` (a GGUF file's) names its family by model_type.
_MODEL_TYPES = {family: family for family in SUPPORTED_ARCHITECTURES.values()} | {"gemma3_text": "gemma3"}
# RoPE types whose frequencies do not depend on the sequence length (built once, as
# transformers builds them). dynamic and longrope switch frequencies with the length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# GGUF files: llama.cpp's `llama` architecture (Llama and Mistral checkpoints), the one
# whose tensor layout (Q/K rows permuted) worker/model/gguf_checkpoint.py undoes.
SUPPORTED_GGUF_MODEL_TYPES = ("llama", "mistral")



def load_hf_config(path: Path, trust_remote_code: bool = False) -> Any:
    """The model's transformers config, checked (see check_supported). A .gguf file's config
    is read from the file's metadata by transformers (context length, heads, RoPE base...)."""
    from transformers import AutoConfig  # transformers: the ingress imports this module

    path = Path(path)
    if is_gguf(path):
        require_gguf()
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    else:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    check_supported(config, gguf=is_gguf(path))
    return config


def family_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None)
    if archs:
        family = SUPPORTED_ARCHITECTURES.get(archs[0])
        if archs[0] in REFUSED_ARCHITECTURES:
            raise UnsupportedModelError(REFUSED_ARCHITECTURES[archs[0]])
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r}; kvserve serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        return family
    model_type = getattr(hf_config, "model_type", None) or "llama"
    if model_type == "gemma3":  # the multimodal config's model_type
        raise UnsupportedModelError(REFUSED_ARCHITECTURES["Gemma3ForConditionalGeneration"])
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; kvserve serves {', '.join(sorted(_MODEL_TYPES))}"
        )
    return _MODEL_TYPES[model_type]


def check_supported(hf_config: Any, gguf: bool = False) -> None:
    """Raise UnsupportedModelError for anything the model code would otherwise ignore:
    another architecture, a quantized checkpoint, a RoPE type, an activation."""
    family = family_of(hf_config)
    if gguf and family not in SUPPORTED_GGUF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF model type {family!r} is not supported; kvserve loads GGUF files of the "
            f"{'/'.join(SUPPORTED_GGUF_MODEL_TYPES)} architecture"
        )
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None:
        check_quantization(family, quant, gguf)
    act = getattr(hf_config, "hidden_act", "silu")
    if family == "gemma3":  # its own switches: worker/model/gemma3_config.py
        check_gemma3(hf_config, SUPPORTED_ROPE_TYPES)
    elif act != "silu":
        raise UnsupportedModelError(f"unsupported activation {act!r}; the Llama family kvserve serves uses silu")
    rope_type = rope_type_of(hf_config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported RoPE type {rope_type!r}; kvserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if family == "deepseek_v3":
        check_deepseek_v3(hf_config)
    if family in ("llama", "mistral", "mixtral", "qwen3_moe") and getattr(hf_config, "layer_types", None):
        kinds = set(hf_config.layer_types) - {"full_attention"}
        if kinds:  # transformers' models of these families ignore layer_types; so would we, silently
            raise UnsupportedModelError(
                f"per-layer attention types {sorted(kinds)} in a {family} config are not supported "
                "(Mistral-style sliding windows use `sliding_window`; Qwen2/Qwen3 use layer_types)"
            )
    if family in ("qwen3_moe", "mixtral", "gpt_oss"):
        check_moe_config(family, hf_config)


def rope_type_of(hf_config: Any) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def layer_sliding_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers applies it:
    Mistral, Mixtral, Qwen3-MoE: `sliding_window` on every layer (Qwen3-MoE's config keeps
    it only with use_sliding_window); Qwen2/Qwen3/gpt-oss: `sliding_window` on the layers
    that `layer_types` marks "sliding_attention" (Qwen2/3 with use_sliding_window: the
    layers from max_window_layers on); Llama: none. A query at position p sees keys p - window < k <= p."""
    family = family_of(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if family == "llama" or window is None:
        return (None,) * num_layers
    if family in _EVERY_LAYER_WINDOW:
        return (int(window),) * num_layers
    types = getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types[:num_layers])


def max_model_len_for(requested: int | None, hf_config: Any) -> int:
    """The engine's max_model_len before the KV cap: the model's context length unless a
    smaller one was asked for (a larger one is cut to it, with a log line)."""
    limit = int(hf_config.max_position_embeddings)
    if requested is None:
        return limit
    if requested > limit:
        logger.warning("max_model_len %d is past the model's context length; using %d", requested, limit)
        return limit
    return requested


def cap_to_kv_capacity(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """No sequence can outgrow the KV pool: cap max_model_len to it, saying so once."""
    capacity = num_blocks * block_size
    if max_model_len > capacity:  # a warning: the operator should see it (INFO is not shown by default)
        logger.warning(
            "max_model_len capped from %d to %d: the KV cache holds %d blocks of %d tokens "
            "(raise engine.kv_cache_bytes / gpu_memory_utilization for longer sequences)",
            max_model_len, capacity, num_blocks, block_size,
        )
        return capacity
    return max_model_len


def eos_token_ids_of(path: Path, hf_config: object) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (Llama 3 lists several)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen = Path(path) / "generation_config.json"
    if not is_gguf(path) and gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return frozenset(ids)


def check_local_model(model: str, trust_remote_code: bool = False) -> None:
    """For `kvserve serve`, before Ray starts: read and check a local model's config
    (UnsupportedModelError, MissingDependencyError, FileNotFoundError). A Hub id is
    checked where it is downloaded, when the worker loads it."""
    if not is_hub_id(model):
        load_hf_config(resolve_model_path(model), trust_remote_code)
