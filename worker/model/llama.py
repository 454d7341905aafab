"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over one flat token batch.

Every linear layer sees all tokens of all sequences at once (selective batching);
only attention is per sequence, through the block tables in AttentionMetadata.
Fused projections: qkv_proj = [q; k; v] rows and gate_up_proj = [gate; up] rows, one
matmul each; the loader writes the Hugging Face tensors into their row ranges.
Tensor parallelism: the model picks a parallel layer class for each projection and gives
it full sizes and the TPContext; the layer works out its shard (worker/model/parallel.py).
No shard arithmetic here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.model.checkpoint_names import Target, llama_target
from worker.model import fused
from worker.model.layers import RMSNorm, RotaryEmbedding
from worker.model.parallel import (
    SINGLE, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear, TPContext,
    VocabParallelEmbedding, shard_range, validate_tp,
)
from worker.model_config import SUPPORTED_ARCHITECTURES, check_supported, family_of, layer_sliding_windows

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaArch", "LlamaForCausalLM"]


@dataclass(frozen=True)
class LlamaArch:
    """The shape of a model, read from its Hugging Face config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Per layer: the sliding window (None: full causal attention); see layer_sliding_windows.
    sliding_windows: tuple[int | None, ...] = ()
    o_proj_bias: bool = False
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss; attention/base.py)

    @classmethod
    def from_hf_config(cls, hf_config: object) -> LlamaArch:
        check_supported(hf_config)  # UnsupportedModelError (a ValueError) names what is supported
        family = family_of(hf_config)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            family=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            o_proj_bias=family in ("llama", "qwen3") and bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_windows=layer_sliding_windows(hf_config, hf_config.num_hidden_layers),
        )

    def validate_tp(self, size: int) -> None:
        """ValueError (clear message) when the model cannot be split over `size` ranks."""
        validate_tp(self.num_heads, self.num_kv_heads, size, self.intermediate_size)


class Attention(nn.Module):
    """Under TP this rank computes its own query heads and the kv heads they attend with;
    the projection decides which (worker/model/parallel.py), so the head counts here are
    the projection's (local) ones."""

    def __init__(
        self,
        arch: LlamaArch,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPContext = SINGLE,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.qkv_proj.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, tp, arch.o_proj_bias)
        self.sinks = AttentionSinks(arch.num_heads, tp) if arch.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        sinks = self.sinks.weight if self.sinks is not None else None
        cos, sin = self.rope.tables(positions, q.dtype)
        if fused.rope_write_kv(q, k, v, cos, sin, kv_cache, meta, self.backend):  # one kernel on CUDA
            out = self.backend.attend(q, kv_cache, meta, self.scale, self.sliding_window, sinks=sinks)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        q, k = fused.rope_qk(q, k, cos, sin, inplace=True)  # q, k: this projection's own
        if sinks is None:
            out = self.backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, self.sliding_window)
        else:
            out = self.backend.forward(
                q, k, v.contiguous(), kv_cache, meta, self.scale, self.sliding_window, sinks=sinks
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class AttentionSinks(nn.Module):
    """One sink logit per query head, this rank's heads (the q heads QKVParallelLinear
    gives it). Loaded by its own rule: the checkpoint holds every head's."""

    def __init__(self, num_heads: int, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.head_range = shard_range(num_heads, tp)
        self.weight = nn.Parameter(torch.empty(self.head_range[1] - self.head_range[0]))

    def num_load_parts(self, kind: str) -> int:
        return 1

    def load_checkpoint_tensor(self, f: object, name: str, kind: str, part: int, dest: torch.Tensor) -> torch.Tensor:
        lo, hi = self.head_range
        tensor = f.get_slice(name)[lo:hi]
        dest.copy_(tensor)
        return tensor


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, arch.intermediate_size, 2, False, tp)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x), self.gate_up_proj.part_size))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: LlamaArch,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPContext = SINGLE,
        sliding_window: int | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        """`mlp`: the feed-forward block (default: the dense MLP; a sparse MoE one in the
        MoE families, worker/model/moe_decoder.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rope, backend, tp, sliding_window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(arch, tp)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        h, x = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm: one kernel on CUDA
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: LlamaArch,
        hf_config: object,
        backend: AttentionBackend,
        max_positions: int,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__()
        self.arch = arch
        rope = RotaryEmbedding(hf_config, arch.head_dim, max_positions)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        windows = arch.sliding_windows or (None,) * arch.num_layers
        self.layers = nn.ModuleList(
            self.make_layer(i, arch, rope, backend, tp, windows[i]) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rope = rope
        if not arch.tie_word_embeddings:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)

    def make_layer(
        self, index: int, arch: LlamaArch, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPContext,
        sliding_window: int | None,
    ) -> nn.Module:
        """Decoder layer `index` (a subclass builds its own MLP or attention kinds)."""
        return DecoderLayer(arch, rope, backend, tp, sliding_window)

    @classmethod
    def arch_from_hf_config(cls, hf_config: object) -> LlamaArch:
        return LlamaArch.from_hf_config(hf_config)

    @classmethod
    def checkpoint_target(cls, name: str, arch: LlamaArch) -> Target | None:
        return llama_target(name, arch.tie_word_embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches: (num_layers, 2, blocks, block_size, Hkv, D).
        Returns final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)
        self.rope.begin_step(positions, x.dtype)  # cos / sin gathered once for every layer
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x, positions, kv_caches[i], meta)
        finally:
            self.rope.end_step()
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(T, V) logits, fp32 unless `fp32` is False (the model dtype: for a batch the
        sampler only takes the argmax of); under TP a collective every rank must join."""
        head = self.embed_tokens if self.arch.tie_word_embeddings else self.lm_head
        return head.logits(hidden, fp32)
