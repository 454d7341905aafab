"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and gpt-oss, on the Llama family's
attention (worker/model/llama.py) with a sparse MoE block (worker/model/moe.py) in place of
the dense MLP where the config says so.

    family     experts in layer i                             routing                 extras
    qwen3_moe  i not in mlp_only_layers, (i+1) % step == 0    softmax, top-k,         qk-norm, dense MLP
               and num_experts > 0 (else a dense MLP)         renormalised if         in the other layers
                                                              norm_topk_prob
    mixtral    every layer                                    softmax, top-k, renorm.
    gpt_oss    every layer                                    top-k, softmax over k   sinks, q/k/v/o biases,
                                                              (router bias)           expert biases, clamped
                                                                                      SwiGLU, sliding/full layers

Checkpoint names (as transformers 5.x saves them): per-expert tensors
`mlp.experts.{e}.{gate,up,down}_proj` (Qwen3-MoE) and `block_sparse_moe.experts.{e}.w{1,3,2}`
(Mixtral), or fused 3-D ones `mlp.experts.gate_up_proj` / `down_proj` (+ `_bias`), which
gpt-oss always uses, interleaved and transposed (FusedExperts reads both).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from torch import nn

from worker.attention.base import AttentionBackend
from worker.model.checkpoint_names import (
    ALL_PARTS, ATTENTION_PARTS, DENSE_MLP_PARTS, Target, layer_target, split_layer_name, top_level_target,
)
from worker.model.layers import RotaryEmbedding, ScaleFirstRMSNorm
from worker.model.llama import MLP, DecoderLayer, LlamaArch, LlamaForCausalLM
from worker.model.moe import SILU, MoEActivation, SparseMoE
from worker.model.moe_checks import num_experts_of
from worker.model.parallel import SINGLE, TPContext, validate_tp

_BLOCK = r"(?:mlp|block_sparse_moe)"
_EXPERT = re.compile(rf"^{_BLOCK}\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)$")
_FUSED = re.compile(rf"^{_BLOCK}\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_ROUTER = re.compile(rf"^{_BLOCK}\.(?:gate|router)\.(weight|bias)$")
# Per-expert projection -> (our parameter, part within the expert: gate 0, up 1).
_EXPERT_PROJ = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", 0), "w2": ("w2", 0),
}


@dataclass(frozen=True)
class MoEArch(LlamaArch):
    """LlamaArch plus the experts. `intermediate_size` is the dense MLP's (layers without
    experts), `moe_intermediate_size` each expert's."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE block (else the dense MLP)
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    activation: MoEActivation = SILU
    expert_bias: bool = False  # router and expert biases (gpt-oss)
    fused_layout: str = "concat"  # how the checkpoint stores fused experts (moe.FUSED_LAYOUTS)
    norm_scale_first: bool = False  # RMSNorm scales before the cast (gpt-oss; layers.py)

    @classmethod
    def from_hf_config(cls, hf_config: object) -> MoEArch:
        base = LlamaArch.from_hf_config(hf_config)  # check_supported runs here
        values = {f.name: getattr(base, f.name) for f in fields(LlamaArch)}
        family = base.family
        n = base.num_layers
        num_experts = num_experts_of(family, hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        values.update(num_experts=num_experts, num_experts_per_tok=int(hf_config.num_experts_per_tok))
        if family == "qwen3_moe":
            step = int(hf_config.decoder_sparse_step)
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            values.update(
                qkv_bias=bias, o_proj_bias=bias, qk_norm=True,
                moe_intermediate_size=int(hf_config.moe_intermediate_size),
                moe_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n)),
                norm_topk_prob=bool(hf_config.norm_topk_prob),
            )
        elif family == "mixtral":
            values.update(
                qkv_bias=False, o_proj_bias=False, qk_norm=False,
                moe_intermediate_size=int(hf_config.intermediate_size), moe_layers=(True,) * n,
            )
        elif family == "gpt_oss":
            values.update(
                qkv_bias=bias, o_proj_bias=bias, qk_norm=False, attention_sinks=True,
                moe_intermediate_size=int(hf_config.intermediate_size), moe_layers=(True,) * n,
                routing="topk_softmax",
                activation=MoEActivation("swiglu_clamp", float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)),
                expert_bias=True, fused_layout="interleaved", norm_scale_first=True,
            )
        else:
            raise ValueError(f"{family!r} is not a mixture-of-experts family")
        return cls(**values)

    def validate_tp(self, size: int) -> None:
        dense = self.intermediate_size if not all(self.moe_layers) else None
        validate_tp(self.num_heads, self.num_kv_heads, size, dense)
        if self.moe_intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's expert intermediate size "
                f"{self.moe_intermediate_size}"
            )


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama family's model with a sparse MoE block in the layers `arch.moe_layers` marks."""

    def __init__(
        self, arch: MoEArch, hf_config: object, backend: AttentionBackend, max_positions: int,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__(arch, hf_config, backend, max_positions, tp)
        if arch.norm_scale_first:
            self.norm = ScaleFirstRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(
        self, index: int, arch: MoEArch, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPContext,
        sliding_window: int | None,
    ) -> nn.Module:
        if arch.moe_layers[index]:
            mlp: nn.Module = SparseMoE(
                arch.hidden_size, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
                routing=arch.routing, renormalize=arch.norm_topk_prob, activation=arch.activation,
                bias=arch.expert_bias, tp=tp, fused_layout=arch.fused_layout,
            )
        else:
            mlp = MLP(arch, tp)
        layer = DecoderLayer(arch, rope, backend, tp, sliding_window, mlp)
        if arch.norm_scale_first:
            layer.input_layernorm = ScaleFirstRMSNorm(arch.hidden_size, arch.rms_norm_eps)
            layer.post_attention_layernorm = ScaleFirstRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        return layer

    @classmethod
    def arch_from_hf_config(cls, hf_config: object) -> MoEArch:
        return MoEArch.from_hf_config(hf_config)

    @classmethod
    def checkpoint_target(cls, name: str, arch: MoEArch) -> Target | None:
        if not name.startswith("model.layers."):
            return top_level_target(name, arch.tie_word_embeddings)
        split = split_layer_name(name)
        if split is None:
            return None
        prefix, rest = split
        experts = prefix + "mlp.experts"
        m = _EXPERT.match(rest)
        if m is not None:
            expert, (param, part) = int(m.group(1)), _EXPERT_PROJ[m.group(2)]
            kind = param if m.group(3) == "weight" else f"{param}_bias"
            return experts, kind, expert * 2 + part if param == "w13" else expert
        m = _FUSED.match(rest)
        if m is not None:
            param = "w13" if m.group(1) == "gate_up_proj" else "w2"
            return experts, param + (m.group(2) or ""), ALL_PARTS
        m = _ROUTER.match(rest)
        if m is not None:
            return prefix + "mlp.gate", m.group(1), 0
        if rest == "self_attn.sinks":
            return prefix + "self_attn.sinks", "weight", 0
        return layer_target(prefix, rest, {**ATTENTION_PARTS, **DENSE_MLP_PARTS})
