"""Model shapes: what the step-cost model and the KV sizing need to know of a model.

A shape is read from a Hugging Face `config.json` (no weights, no tokenizer): the named
shapes shipped under `shapes/` are copies of the published configs' architecture fields,
and any model directory or config file works too (e.g. the embedded default model). A
.gguf file keeps its config in binary metadata: it is read by worker.model_config, the
reader the engine loads the model with (transformers, so torch; only a real device or
`kvserve calibrate` asks for one).

Counting (Llama family, Qwen3 the same plus negligible q/k norms; biases ignored):
    per layer:  q: hidden x heads*head_dim      k, v: hidden x kv_heads*head_dim each
                o: heads*head_dim x hidden      gate, up: hidden x inter each   down: inter x hidden
    embedding:  vocab x hidden                  LM head: vocab x hidden (the same matrix when tied)
MLA attention and MoE layers (DeepSeek-V3) count as worker/costs/shape_parts.py says; an MLA
model's KV is one latent row per token per layer, and its matmul_params are the ACTIVE
weights a token multiplies by (shared + top-k experts), its weight_bytes all of them.

KV sizing follows the layers' cache kinds (kv/kv_groups.py): a config with sliding-window
layers (`layer_types` "sliding_attention", or Mistral's `sliding_window` on every layer)
gets the engine's layout, one pool block covering layers_per_group layers, and its
sliding groups hold only their window's blocks, as on a real device.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv.kv_groups import KVLayout, full_layout, layout_for_windows
from worker.api import is_gguf
from worker.costs.quant_bytes import quantized_weight_bytes
from worker.costs.shape_parts import MLAShape, MoEShape
from worker.model_config import load_hf_config

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"

# config.json "torch_dtype" / "dtype" -> bytes per weight and per KV element.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DEFAULT_DTYPE_BYTES = 2  # the serving dtype when a config names none (bf16)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAShape | None = None  # multi-head latent attention (head_dim: qk_nope + qk_rope)
    moe: MoEShape | None = None  # mixture-of-experts feed-forward layers
    # Per layer: its sliding window, None for full attention (() : every layer full).
    layer_windows: tuple[int | None, ...] = ()
    # Bytes per weight of the layers' projections of a quantized checkpoint
    # (worker/costs/quant_bytes.py); None: dtype_bytes.
    weight_dtype_bytes: float | None = None
    # Bytes per KV element: 1 for an FP8 KV cache (engine.kv_cache_dtype fp8); None: dtype_bytes.
    kv_dtype_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "dtype_bytes", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"model shape {self.name!r}: {field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model shape {self.name!r}: num_heads ({self.num_heads}) is not a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "", dtype_bytes: int | None = None) -> ModelShape:
        """`dtype_bytes` None: from the config's torch_dtype/dtype, else bf16's 2 bytes."""
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            mla = MLAShape.from_hf_config(cfg)
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else cfg.get("head_dim") or hidden // heads
            if dtype_bytes is None:
                dtype = cfg.get("torch_dtype") or cfg.get("dtype")
                dtype_bytes = _DTYPE_BYTES.get(str(dtype), DEFAULT_DTYPE_BYTES)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
            return cls(
                name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                dtype_bytes=dtype_bytes,
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                mla=mla,
                moe=MoEShape.from_hf_config(cfg),
                layer_windows=_layer_windows(cfg),
                weight_dtype_bytes=quantized_weight_bytes(cfg.get("quantization_config")),
            )
        except KeyError as e:
            raise ValueError(f"model config {name!r} lacks {e.args[0]!r} (a Llama-family config.json is expected)") from None

    # -- counts the cost model uses --------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """A dense layer's weights (attention, the dense MLP, the two norms)."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.attention_params(h, self.num_heads)
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h

    def _layers_params(self, active: bool) -> int:
        """Every layer's weights (all, or those one token multiplies by), norms included."""
        if self.moe is None:
            return self.num_layers * self.layer_params
        dense = min(self.moe.num_dense_layers, self.num_layers)
        moe_layer = self.attention_params + self.moe.layer_params(self.hidden_size, active) + 2 * self.hidden_size
        return dense * self.layer_params + (self.num_layers - dense) * moe_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every weight the device holds: layers, embedding, LM head (once when tied), final norm."""
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self._layers_params(active=False) + embedding + lm_head + self.hidden_size

    @property
    def projection_bytes(self) -> float:
        """Bytes per weight of the layers' projections (quantized or the model dtype)."""
        return self.weight_dtype_bytes if self.weight_dtype_bytes is not None else float(self.dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        """Memory the weights take on the device: the layers' projections at their
        (maybe quantized) bytes, norms, embedding and LM head in the model dtype."""
        projections = self._layers_params(active=False) - self.num_layers * 2 * self.hidden_size
        return int(projections * self.projection_bytes) + (self.num_params - projections) * self.dtype_bytes

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by in the layers (not the LM head, which only
        sampled rows see, nor the embedding, which is a row lookup)."""
        return self._layers_params(active=True) - self.num_layers * 2 * self.hidden_size

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer (what a full-attention sequence holds per
        token, and what a transfer of its whole KV moves)."""
        kv_bytes = self.kv_dtype_bytes or self.dtype_bytes
        if self.mla is not None:  # one latent row per token per layer
            return self.num_layers * self.mla.latent_dim * kv_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes

    def kv_layout(self) -> KVLayout:
        """The engine's KV groups for this model (kv/kv_groups.py)."""
        if not self.layer_windows or all(w is None for w in self.layer_windows):
            return full_layout(self.num_layers)
        return layout_for_windows(self.layer_windows)

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one pool block: block_size tokens over the layer slots of one group
        (one layer's share of kv_bytes_per_token, whatever a layer's page holds)."""
        per_layer = self.kv_bytes_per_token() // self.num_layers
        return per_layer * self.kv_layout().layers_per_group * block_size


def _layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window from a config.json (as worker/model_config.layer_sliding_windows
    reads a loaded config): `layer_types` where given, Mistral's window on every layer."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types[:num_layers])
    if cfg.get("model_type") == "mistral":
        return (int(window),) * num_layers
    return ()


def named_shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_shape(name_or_path: str, dtype_bytes: int | None = None) -> ModelShape:
    """A named shape ("llama-3-8b"), a config.json, a model directory holding one, or a
    .gguf file."""
    named = SHAPES_DIR / f"{name_or_path}.json"
    if named.is_file():
        return ModelShape.from_hf_config(json.loads(named.read_text()), name_or_path, dtype_bytes)
    path = Path(name_or_path).expanduser()
    if path.is_file() and is_gguf(path):
        return ModelShape.from_hf_config(load_hf_config(path).to_dict(), path.stem, dtype_bytes)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model shape {name_or_path!r} is neither a named shape ({', '.join(named_shapes())}) "
            f"nor a config.json / model directory / .gguf file"
        )
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelShape.from_hf_config(json.loads(path.read_text()), name, dtype_bytes)
