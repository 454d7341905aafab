"""Reading the MoE families' configs: the registry's class for each family, what each
switch builds (sparse / dense layers, routing, windows, sinks, biases), the checkpoint
names each tensor loads under, gpt-oss's YaRN RoPE as transformers computes it, and the
configs refused with a clear error."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.support.tiny_models import SLIDING_WINDOW
from worker.model.checkpoint_names import ALL_PARTS
from worker.model.llama import LlamaForCausalLM
from worker.model.moe_decoder import MoEArch, MoEForCausalLM
from worker.model.registry import MODEL_CLASSES, arch_for, model_class, model_class_for
from worker.model_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError, check_supported, load_hf_config

if TYPE_CHECKING:
    from tests.unit.worker.models.conftest import TinyMoEModels


def test_every_supported_family_has_a_model_class() -> None:
    assert set(SUPPORTED_ARCHITECTURES.values()) <= set(MODEL_CLASSES)
    assert model_class("qwen3") is LlamaForCausalLM
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        assert model_class(family) is MoEForCausalLM
    with pytest.raises(UnsupportedModelError, match="no model class for family 'gemma9'"):
        model_class("gemma9")


def test_qwen3_moe_sparse_and_dense_layers(tiny_moe: TinyMoEModels) -> None:
    arch = arch_for(load_hf_config(tiny_moe("qwen3_moe")))
    assert isinstance(arch, MoEArch)
    assert arch.moe_layers == (True, False, True)  # mlp_only_layers=[1]
    assert (arch.norm_topk_prob, arch.qkv_bias, arch.o_proj_bias, arch.qk_norm) == (False, True, True, True)
    norm = arch_for(load_hf_config(tiny_moe("qwen3_moe_norm")))
    assert norm.moe_layers == (False, True, False, True)  # decoder_sparse_step=2
    assert norm.norm_topk_prob and norm.routing == "softmax_topk"


def test_mixtral_and_gpt_oss_switches(tiny_moe: TinyMoEModels) -> None:
    mixtral = arch_for(load_hf_config(tiny_moe("mixtral_swa")))
    assert mixtral.sliding_windows == (SLIDING_WINDOW, SLIDING_WINDOW)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True, True) and not mixtral.attention_sinks
    gpt = arch_for(load_hf_config(tiny_moe("gpt_oss")))
    assert gpt.sliding_windows == (SLIDING_WINDOW, None, SLIDING_WINDOW, None)
    assert gpt.attention_sinks and gpt.expert_bias and gpt.qkv_bias and gpt.o_proj_bias
    assert (gpt.routing, gpt.activation.kind, gpt.fused_layout) == ("topk_softmax", "swiglu_clamp", "interleaved")


def test_qwen3_moe_window_covers_every_layer() -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=3, use_sliding_window=True, sliding_window=32,
                            architectures=["Qwen3MoeForCausalLM"])
    assert MoEArch.from_hf_config(config).sliding_windows == (32, 32, 32)
    config = Qwen3MoeConfig(num_hidden_layers=3, sliding_window=32, architectures=["Qwen3MoeForCausalLM"])
    assert MoEArch.from_hf_config(config).sliding_windows == (None, None, None)


@pytest.mark.parametrize("name,target", [
    ("model.layers.2.mlp.experts.5.up_proj.weight", ("layers.2.mlp.experts", "w13", 11)),
    ("model.layers.2.mlp.experts.5.down_proj.weight", ("layers.2.mlp.experts", "w2", 5)),
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", ("layers.0.mlp.experts", "w13", 6)),
    ("model.layers.0.block_sparse_moe.experts.3.w3.weight", ("layers.0.mlp.experts", "w13", 7)),
    ("model.layers.0.block_sparse_moe.experts.3.w2.weight", ("layers.0.mlp.experts", "w2", 3)),
    ("model.layers.0.block_sparse_moe.gate.weight", ("layers.0.mlp.gate", "weight", 0)),
    ("model.layers.1.mlp.router.bias", ("layers.1.mlp.gate", "bias", 0)),
    ("model.layers.1.mlp.experts.gate_up_proj", ("layers.1.mlp.experts", "w13", ALL_PARTS)),
    ("model.layers.1.mlp.experts.down_proj_bias", ("layers.1.mlp.experts", "w2_bias", ALL_PARTS)),
    ("model.layers.1.self_attn.sinks", ("layers.1.self_attn.sinks", "weight", 0)),
    ("model.layers.1.self_attn.k_proj.bias", ("layers.1.self_attn.qkv_proj", "bias", 1)),
    ("model.layers.1.mlp.gate_proj.weight", ("layers.1.mlp.gate_up_proj", "weight", 0)),  # a dense layer
    ("lm_head.weight", ("lm_head", "weight", 0)),
])
def test_checkpoint_names(tiny_moe: TinyMoEModels, name: str, target: tuple) -> None:
    arch = arch_for(load_hf_config(tiny_moe("qwen3_moe")))
    assert model_class_for(load_hf_config(tiny_moe("qwen3_moe"))).checkpoint_target(name, arch) == target


def test_gpt_oss_yarn_rope_is_transformers(tiny_moe: TinyMoEModels) -> None:
    """Our cos/sin tables and rotation against gpt-oss's own rotary embedding and its
    _apply_rotary_emb (halves, YaRN inverse frequencies and attention factor)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding, apply_rotary_pos_emb

    from worker.model.layers import RotaryEmbedding

    config = load_hf_config(tiny_moe("gpt_oss"))
    assert config.rope_parameters["rope_type"] == "yarn"
    ours = RotaryEmbedding(config, config.head_dim, 512)
    theirs = GptOssRotaryEmbedding(config)
    positions = torch.arange(512)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    q = torch.randn(512, 4, config.head_dim)
    k = torch.randn(512, 2, config.head_dim)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def _config(family: str, **overrides: object) -> object:
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    cls, arch = {"gpt_oss": (GptOssConfig, "GptOssForCausalLM"), "mixtral": (MixtralConfig, "MixtralForCausalLM"),
                 "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM")}[family]
    return cls(num_hidden_layers=2, architectures=[arch], **overrides)


@pytest.mark.parametrize("family,overrides,message", [
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer types \\['chunked_attention'\\]"),
    ("mixtral", {"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4 on a mixtral model"),
    ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 3}, "between 1 and the number of experts"),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 0}, "between 1 and the number of experts"),
    ("qwen3_moe", {"layer_types": ["sliding_attention", "full_attention"]}, "per-layer attention types"),
    ("mixtral", {"hidden_act": "gelu"}, "unsupported activation"),
])
def test_unbuilt_switches_are_refused(family: str, overrides: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(_config(family, **overrides))


def test_refused_before_loading(tmp_path: Path) -> None:
    """`kvserve serve` reads config.json alone: a bad one fails there, torch-free."""
    config = _config("gpt_oss", layer_types=["sliding_attention", "chunked_attention"])
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        load_hf_config(tmp_path)
