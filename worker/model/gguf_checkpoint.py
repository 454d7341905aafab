"""A .gguf file (llama.cpp's format) as a checkpoint the loader reads like safetensors.

Tensors are read with the `gguf` package and dequantized (Q4_1, Q8_0, ... -> float32);
the loader copies them into the model in the serving dtype. Names map to Hugging Face's:

    token_embd          -> model.embed_tokens        output_norm     -> model.norm
    output              -> lm_head                   blk.N.attn_norm -> model.layers.N.input_layernorm
    blk.N.attn_q/k/v    -> ...self_attn.q/k/v_proj   blk.N.attn_output -> ...self_attn.o_proj
    blk.N.ffn_norm      -> ...post_attention_layernorm
    blk.N.ffn_gate/up/down -> ...mlp.gate/up/down_proj

llama.cpp's converter permutes the rows of Q and K of the `llama` architecture (its RoPE
pairs dimensions (2i, 2i+1); Hugging Face's rotate-half pairs (i, i + d/2)). Within each
head, row 2i + j of the file is row i + j * d/2 of the HF tensor; read_tensor undoes it,
as transformers' own GGUF loader does (LlamaTensorProcessor). Any tensor this table does
not name is refused, never skipped.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from worker.api import require_gguf
from worker.model_config import UnsupportedModelError

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order -> Hugging Face's (see the module docstring)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """keys() in HF names; get_tensor / get_slice return dequantized float32 tensors (a
    slice is taken from the whole tensor: GGUF quantizes in row blocks, not per shard)."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        require_gguf()
        from gguf import GGUFReader, dequantize  # optional dependency: require_gguf() gives the install hint

        self._dequantize = dequantize
        reader = GGUFReader(path)
        arch = _string_field(reader, "general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; kvserve loads {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        self._tensors: dict[str, Any] = {}
        unknown = []
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                unknown.append(tensor.name)
            else:
                self._tensors[name] = tensor
        if unknown:  # e.g. rope_freqs (custom RoPE frequencies) that the config does not carry
            raise UnsupportedModelError(
                f"GGUF tensors kvserve cannot place: {unknown[:6]}; it loads {sorted(_LAYER)} per block "
                f"and {sorted(_GLOBAL)}"
            )
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        weight = torch.from_numpy(self._dequantize(tensor.data, tensor.tensor_type).copy()).float()
        for proj, num_heads in self._heads.items():
            if f".{proj}." in name:
                weight = unpermute_rows(weight, num_heads)
        return weight

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)


def _string_field(reader: Any, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        return "?"
    return bytes(field.parts[field.data[0]]).decode("utf-8")
