"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text) over one flat token batch.

Per layer, as transformers' modeling_gemma3.py computes it:

    x = embed(ids) * sqrt(hidden)                       (the scale in the weights' dtype)
    h = x + post_attn_norm(attn(input_norm(x)))         attention: q/k RMSNorm per head,
    x = h + post_ff_norm(mlp(pre_ff_norm(h)))           then RoPE, scale query_pre_attn_scalar^-0.5
    mlp(x) = down(gelu_tanh(gate(x)) * up(x))
    logits = cap * tanh(lm_head(norm(x)) / cap)         when final_logit_softcapping is set

Gemma's RMSNorm scales by (1 + weight), in fp32, then casts (not Llama's cast, then scale).
Local layers ("sliding_attention") see the last `sliding_window` positions and rotate with
their own RoPE (rope_parameters["sliding_attention"], the config's rope_local_base_freq);
global layers ("full_attention") with rope_parameters["full_attention"]. The KV manager
gives the local layers' blocks back as they leave the window (kv/kv_groups.py).
Module names follow the Llama family's (qkv_proj, o_proj, gate_up_proj, down_proj), so the
loader's fused parts, tensor parallelism and LoRA apply unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.model.checkpoint_names import Target, llama_target
from worker.model.gemma3_config import check_gemma3, gemma3_layer_types, gemma3_rope_parameters
from worker.model_config import SUPPORTED_ROPE_TYPES
from worker.model.layers import RotaryEmbedding
from worker.model.parallel import (
    SINGLE, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear, TPContext,
    VocabParallelEmbedding, validate_tp,
)


@dataclass(frozen=True)
class Gemma3Arch:
    """The shape of a Gemma 3 text model, read from its Hugging Face config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    # Per layer: the sliding window (None: full causal attention).
    sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Gemma3Arch:
        check_gemma3(hf_config, SUPPORTED_ROPE_TYPES)
        types = tuple(gemma3_layer_types(hf_config))
        window = getattr(hf_config, "sliding_window", None)
        num_heads = hf_config.num_attention_heads
        return cls(
            family="gemma3",
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            max_position_embeddings=hf_config.max_position_embeddings,
            layer_types=types,
            sliding_windows=tuple(int(window) if t == "sliding_attention" else None for t in types),
        )

    def validate_tp(self, size: int) -> None:
        """ValueError (clear message) when the model cannot be split over `size` ranks."""
        validate_tp(self.num_heads, self.num_kv_heads, size, self.intermediate_size)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), normalised and scaled in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class LayerTypeRotary(RotaryEmbedding):
    """RoPE tables of one layer type: rope_parameters[layer_type] (its base and scaling)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str) -> None:
        self.layer_type = layer_type
        super().__init__(hf_config, head_dim, max_positions)

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        params = gemma3_rope_parameters(self._hf_config, self.layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            dim = self._head_dim
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self._hf_config, torch.device("cpu"), layer_type=self.layer_type)
        return inv_freq.float(), float(scaling)


class Gemma3Attention(nn.Module):
    def __init__(self, arch: Gemma3Arch, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPContext,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, False, tp
        )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.qkv_proj.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, tp)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.rope = rope
        self.backend = backend
        self.scale = arch.query_pre_attn_scalar**-0.5
        self.sliding_window = sliding_window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        out = self.backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, arch: Gemma3Arch, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, arch.intermediate_size, 2, False, tp)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.part_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: Gemma3Arch, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPContext,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.self_attn = Gemma3Attention(arch, rope, backend, tp, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.mlp = Gemma3MLP(arch, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, arch: Gemma3Arch, hf_config: Any, backend: AttentionBackend, max_positions: int,
                 tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        # One RoPE table per layer type (local and global layers rotate with their own base).
        self.ropes = nn.ModuleDict({
            t: LayerTypeRotary(hf_config, arch.head_dim, max_positions, t) for t in sorted(set(arch.layer_types))
        })
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, self.ropes[arch.layer_types[i]], backend, tp, arch.sliding_windows[i])
            for i in range(arch.num_layers)
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.tie_word_embeddings:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)

    @classmethod
    def arch_from_hf_config(cls, hf_config: Any) -> Gemma3Arch:
        return Gemma3Arch.from_hf_config(hf_config)

    @classmethod
    def checkpoint_target(cls, name: str, arch: Gemma3Arch) -> Target | None:
        """Llama's names, plus the four per-layer norms and q/k norms (same-named modules).
        A checkpoint saved from the multimodal class prefixes `language_model.`: refused by
        its architecture before loading."""
        return llama_target(name, arch.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches[i]: layer i's paged cache. Returns final
        hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the scale as a tensor in the weights' dtype.
        x = x * torch.tensor(self.arch.hidden_size**0.5, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kv_caches[i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, V) fp32 logits, soft-capped when the config says so; under TP a collective
        every rank must join."""
        head = self.embed_tokens if self.arch.tie_word_embeddings else self.lm_head
        logits = head.logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
