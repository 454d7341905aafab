"""Hugging Face tensor names -> where they load in our models (the part every family
shares; a model class adds its own names in its `checkpoint_target`).

A target is (our module, parameter name, part): fused projections take several HF tensors
into their row ranges, one part each:
    qkv_proj      parts 0 / 1 / 2 = q_proj / k_proj / v_proj
    gate_up_proj  parts 0 / 1     = gate_proj / up_proj
Expert weights (worker/model/moe.py) number their parts per expert; ALL_PARTS marks a
checkpoint tensor that fills every part of its parameter at once (experts stored fused).
"""
from __future__ import annotations

import re

Target = tuple[str, str, int]
ALL_PARTS = -1

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

ATTENTION_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
}
DENSE_MLP_PARTS = {
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def top_level_target(name: str, tie_word_embeddings: bool) -> Target | None:
    """The embedding, final norm and LM head (None: not one of them, or a tied head)."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens", "weight", 0
    if name == "model.norm.weight":
        return "norm", "weight", 0
    if name == "lm_head.weight" and not tie_word_embeddings:
        return "lm_head", "weight", 0
    return None


def split_layer_name(name: str) -> tuple[str, str] | None:
    """"model.layers.3.self_attn.q_proj.weight" -> ("layers.3.", "self_attn.q_proj.weight")."""
    m = _LAYER.match(name)
    return None if m is None else (f"layers.{m.group(1)}.", m.group(2))


def layer_target(prefix: str, rest: str, fused: dict[str, tuple[str, int]]) -> Target | None:
    """A decoder layer's tensor: into a fused projection's part when `fused` names its
    module, else into the module of the same name (norms, o_proj, ...)."""
    if "rotary_emb" in rest:
        return None
    module, _, kind = rest.rpartition(".")
    if module in fused:
        dest, part = fused[module]
        return prefix + dest, kind, part
    return prefix + module, kind, 0


def llama_target(name: str, tie_word_embeddings: bool) -> Target | None:
    """The Llama family's names: attention and a dense MLP in every layer."""
    if not name.startswith("model.layers."):
        return top_level_target(name, tie_word_embeddings)
    split = split_layer_name(name)
    if split is None:
        return None
    return layer_target(*split, {**ATTENTION_PARTS, **DENSE_MLP_PARTS})
