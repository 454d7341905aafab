"""From a checkpoint's family (worker/model_config.py `family_of`) to the model class that
serves it; the engine (loader, model runner, TP runner) builds models only through here.

A model class registered here provides (see `CausalLM`):

    arch_from_hf_config(hf_config) -> arch      its shape, parsed from the HF config; the
                                                arch has vocab_size, num_layers, num_heads,
                                                num_kv_heads, head_dim and validate_tp(size)
    checkpoint_target(name, arch) -> Target     HF tensor name -> where it loads
                                                (worker/model/checkpoint_names.py), None = not ours
    cls(arch, hf_config, backend, max_positions, tp)   built on `meta` by the loader
    forward(input_ids, positions, kv_caches, meta) -> hidden;  compute_logits(hidden)

Classes are named by import path and imported on first use, so that reading the table
costs nothing and a family's module (and its dependencies) loads only when served.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from worker.model_config import UnsupportedModelError, family_of

# family -> "module:class". Every family in model_config.SUPPORTED_ARCHITECTURES has a row.
MODEL_CLASSES: dict[str, str] = {
    "llama": "worker.model.llama:LlamaForCausalLM",
    "mistral": "worker.model.llama:LlamaForCausalLM",
    "qwen2": "worker.model.llama:LlamaForCausalLM",
    "qwen3": "worker.model.llama:LlamaForCausalLM",
    "gemma3": "worker.model.gemma3:Gemma3ForCausalLM",
    "qwen3_moe": "worker.model.moe_decoder:MoEForCausalLM",
    "mixtral": "worker.model.moe_decoder:MoEForCausalLM",
    "gpt_oss": "worker.model.moe_decoder:MoEForCausalLM",
    "deepseek_v3": "worker.model.deepseek_v3:DeepseekV3ForCausalLM",
}


class CausalLM(Protocol):
    """What the engine needs of a model class (an nn.Module subclass)."""

    arch: Any
    layers: torch.nn.ModuleList

    @classmethod
    def arch_from_hf_config(cls, hf_config: Any) -> Any: ...

    @classmethod
    def checkpoint_target(cls, name: str, arch: Any) -> tuple[str, str, int] | None: ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, meta: Any
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def register_model(family: str, path: str) -> None:
    """Add (or replace) a family's class, as "module:class"."""
    MODEL_CLASSES[family] = path


def model_class(family: str) -> type[CausalLM]:
    path = MODEL_CLASSES.get(family)
    if path is None:
        raise UnsupportedModelError(
            f"no model class for family {family!r}; kvserve builds {', '.join(sorted(MODEL_CLASSES))}"
        )
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def model_class_for(hf_config: Any) -> type[CausalLM]:
    """The class serving this config (UnsupportedModelError when none does)."""
    return model_class(family_of(hf_config))


def arch_for(hf_config: Any) -> Any:
    """The config's arch, parsed (and checked) by its model class."""
    return model_class_for(hf_config).arch_from_hf_config(hf_config)
