"""What kvserve refuses to load (clearly, naming what it supports) and how it sizes
max_model_len; trust_remote_code reaching transformers; the GGUF name map and Q/K order."""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from cluster import cli
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.model.gguf_checkpoint import hf_name, unpermute_rows
from worker.model_config import UnsupportedModelError, load_hf_config, load_tokenizer
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def _variant(tiny_model: TinyModels, tmp_path: Path, family: str = "llama", **changes: Any) -> Path:
    """A copy of a tiny checkpoint whose config.json has `changes` applied."""
    out = tmp_path / "model"
    shutil.copytree(tiny_model(family), out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}}}, "asymmetric"),
    ({"quant_method": "mxfp4"}, "mxfp4 on a llama model"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     "kv_cache_scheme"),
])
def test_quantized_formats_not_built_are_refused(
    quant: dict, message: str, tiny_model: TinyModels, tmp_path: Path
) -> None:
    """The refusal names what is missing and the formats kvserve loads (worker/model/quant/spec.py)."""
    path = _variant(tiny_model, tmp_path, quantization_config=quant)
    with pytest.raises(UnsupportedModelError, match=f"{message}.*kvserve loads fp8 .block-scaled"):
        load_hf_config(path)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "made_up"])
def test_length_dependent_or_unknown_rope_is_refused(rope_type: str, tiny_model: TinyModels, tmp_path: Path) -> None:
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=256)
    path = _variant(tiny_model, tmp_path, rope_parameters=params, rope_scaling=params)
    with pytest.raises(UnsupportedModelError, match=f"RoPE type '{rope_type}'.*default, linear, llama3, yarn"):
        load_hf_config(path)


def test_other_architectures_are_refused(tiny_model: TinyModels, tmp_path: Path) -> None:
    path = _variant(tiny_model, tmp_path, architectures=["GemmaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="'GemmaForCausalLM'.*LlamaForCausalLM, MistralForCausalLM"):
        load_hf_config(path)


def test_per_layer_attention_types_a_llama_would_ignore_are_refused(tiny_model: TinyModels, tmp_path: Path) -> None:
    path = _variant(tiny_model, tmp_path, layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        load_hf_config(path)


def test_serve_refuses_before_ray_starts(
    tiny_model: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _variant(tiny_model, tmp_path, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    ray_loaded = "ray" in sys.modules
    assert cli.main(["serve", "--model", str(path)]) == 2
    assert "unsupported quantized checkpoint: quant_method 'bitsandbytes'" in capsys.readouterr().err
    if not ray_loaded:
        assert "ray" not in sys.modules  # refused before `import ray`, let alone ray.init


def _engine(model_dir: Path, num_blocks: int, max_model_len: int | None = None) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=num_blocks),
        SchedulerConfig(max_model_len=max_model_len),
    ))


def test_max_model_len_defaults_to_the_models_context_length(tiny_llama: Path) -> None:
    assert _engine(tiny_llama, num_blocks=256).max_model_len == 1024  # max_position_embeddings


def test_max_model_len_is_capped_by_the_kv_pool_with_a_log_line(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="worker.model_config"):
        engine = _engine(tiny_llama, num_blocks=20)
    assert engine.max_model_len == 20 * 16
    assert "max_model_len capped from 1024 to 320" in caplog.text


def test_max_model_len_asked_for(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _engine(tiny_llama, num_blocks=256, max_model_len=100).max_model_len == 100
    with caplog.at_level(logging.WARNING, logger="worker.model_config"):
        assert _engine(tiny_llama, num_blocks=256, max_model_len=5000).max_model_len == 1024
    assert "past the model's context length" in caplog.text


def test_trust_remote_code_reaches_transformers(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    seen: list[tuple[str, object]] = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def spy(*args: Any, _real: Any = real, _name: str = cls.__name__, **kwargs: Any) -> Any:
            seen.append((_name, kwargs.get("trust_remote_code")))
            raise RuntimeError("stop here")  # only the arguments matter

        monkeypatch.setattr(cls, "from_pretrained", spy)
    for value in (True, False):
        for load in (load_hf_config, load_tokenizer):
            with pytest.raises(RuntimeError, match="stop here"):
                load(tiny_llama, value)
    assert seen == [("AutoConfig", True), ("AutoTokenizer", True), ("AutoConfig", False), ("AutoTokenizer", False)]


def test_gguf_names_map_to_hugging_face_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight") is None  # refused by GGUFCheckpoint, never skipped


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpps_permutation(num_heads: int) -> None:
    head_dim, cols = 8, 5
    w = torch.randn(num_heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (numpy there, same reshapes).
    permuted = w.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    torch.testing.assert_close(unpermute_rows(permuted, num_heads), w, rtol=0, atol=0)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'kvserve[gguf]')")
    writer = gguf.GGUFWriter(path, arch)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_reads_dequantized_tensors_in_hf_order(tmp_path: Path) -> None:
    from worker.model.gguf_checkpoint import GGUFCheckpoint

    q = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)  # 2 heads of dim 4, 4 columns
    norm = np.ones(4, dtype=np.float32)
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"blk.0.attn_q.weight": q, "blk.0.attn_norm.weight": norm})
    checkpoint = GGUFCheckpoint(path, num_heads=2, num_kv_heads=1)
    assert sorted(checkpoint.keys()) == ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"]
    got = checkpoint.get_tensor("model.layers.0.self_attn.q_proj.weight")
    torch.testing.assert_close(got, unpermute_rows(torch.from_numpy(q), 2))
    assert not torch.equal(got, torch.from_numpy(q))  # rows really reordered: 0, 2, 1, 3 per head
    assert got[:4, 0].tolist() == [0.0, 8.0, 4.0, 12.0]
    torch.testing.assert_close(checkpoint.get_slice("model.layers.0.input_layernorm.weight")[1:3], torch.ones(2))


def test_gguf_tensors_it_cannot_place_are_refused(tmp_path: Path) -> None:
    from worker.model.gguf_checkpoint import GGUFCheckpoint

    tensors = {"token_embd.weight": np.zeros((8, 4), np.float32), "rope_freqs.weight": np.ones(2, np.float32)}
    path = _write_gguf(tmp_path / "m.gguf", "llama", tensors)
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight"):
        GGUFCheckpoint(path, num_heads=1, num_kv_heads=1)


def test_gguf_architectures_other_than_llama_are_refused(tmp_path: Path) -> None:
    from worker.model.gguf_checkpoint import GGUFCheckpoint

    path = _write_gguf(tmp_path / "m.gguf", "qwen2", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'qwen2'.*llama"):
        GGUFCheckpoint(path, num_heads=1, num_kv_heads=1)
