"""Quantized checkpoints in each publisher's layout (tests/support/quant_checkpoints.py):
kvserve's engine loads the quantized files (worker/model/quant/, dequantized at load on
CPU) and its greedy outputs equal transformers' on the same dequantized weights, token for
token; a corrupt scale or a shape mismatch is a clear error at load."""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.support.quant_checkpoints import DENSE_FORMATS, make_quantized
from tests.support.tiny_models import hf_greedy
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine
from worker.model.quant.layout import CorruptCheckpointError

if TYPE_CHECKING:
    from tests.conftest import TinyModels
    from tests.unit.worker.models.conftest import TinyMoEModels

VOCAB = 512


def _prompts(n: int = 6, seed: int = 7) -> tuple[list[list[int]], list[int]]:
    """Short and block-crossing prompts (16-token blocks), two sharing a 20-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 5, 17, 33]))] for _ in range(n - 2)]
    prompts += [prefix + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (3, 9)]
    return prompts, [12] * len(prompts)


def _engine(model_dir: Path) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=64),
        SchedulerConfig(max_num_batched_tokens=24),  # chunked prefills
    ))


def _check_same_as_hf(qdir: Path, rdir: Path, run_engine: Callable) -> None:
    prompts, max_tokens = _prompts()
    expected = hf_greedy(rdir, prompts, max_tokens)
    got = run_engine(_engine(qdir), prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens])
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert len({tuple(e) for e in expected}) > 1  # varied outputs: a wrong weight would show


@pytest.mark.parametrize("fmt", DENSE_FORMATS)
def test_dense_format_matches_transformers_on_dequantized_weights(
    fmt: str, tiny_model: TinyModels, tmp_path: Path, run_engine: Callable
) -> None:
    qdir, rdir = make_quantized(tiny_model("llama"), tmp_path, fmt)
    _check_same_as_hf(qdir, rdir, run_engine)


def test_mxfp4_gpt_oss_experts_match_transformers(
    tiny_moe: TinyMoEModels, tmp_path: Path, run_engine: Callable
) -> None:
    qdir, rdir = make_quantized(tiny_moe("gpt_oss"), tmp_path, "mxfp4")
    _check_same_as_hf(qdir, rdir, run_engine)


def test_quantized_weights_really_differ_from_the_original(tiny_model: TinyModels, tmp_path: Path) -> None:
    """The reference runs on dequantized weights, not on the unquantized original."""
    from safetensors.torch import load_file

    src = tiny_model("llama")
    _, rdir = make_quantized(src, tmp_path, "awq")
    name = "model.layers.0.self_attn.q_proj.weight"
    original, ref = load_file(src / "model.safetensors")[name], load_file(rdir / "model.safetensors")[name]
    assert not torch.equal(original, ref)
    assert torch.allclose(original, ref, atol=0.25 * float(original.abs().max()))


def _rewrite(qdir: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(qdir / "model.safetensors")
    tensors[name] = tensor
    save_file(tensors, qdir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("fmt,part,corrupt,message", [
    ("fp8_block", "weight_scale_inv", lambda t: t[:, :1].contiguous(), "shape"),
    ("fp8_block", "weight_scale_inv", lambda t: t * float("nan"), "non-finite scale"),
    ("awq", "scales", lambda t: t[:1].contiguous(), "shape"),
    ("gptq_desc_act", "g_idx", lambda t: t + 100, "groups outside"),
    ("ct_w4a16", "weight_packed", lambda t: t[:, :-1].contiguous(), "shape"),
    ("ct_fp8_channel", "weight_scale", lambda t: t.to(torch.int32), "scales must be floats"),
])
def test_corrupt_scales_or_shapes_are_clear_errors_at_load(
    fmt: str, part: str, corrupt: Callable, message: str, tiny_model: TinyModels, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, fmt)
    name = f"model.layers.1.mlp.down_proj.{part}"
    _rewrite(qdir, name, corrupt(load_file(qdir / "model.safetensors")[name]))
    with pytest.raises(CorruptCheckpointError, match=f"tensor {name}: {message}"):
        _engine(qdir)


@pytest.mark.parametrize("fmt,part,message", [
    ("ct_fp8_tensor", "weight_scale", "model.layers.0.mlp.up_proj has .*input_scale but lacks .*up_proj.weight_scale"),
    ("fp8_block", "weight_scale_inv", "model.layers.0.mlp.up_proj.weight is torch.float8_e4m3fn but has no scales"),
])
def test_a_missing_scale_is_named(fmt: str, part: str, message: str, tiny_model: TinyModels, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, fmt)
    tensors = load_file(qdir / "model.safetensors")
    del tensors[f"model.layers.0.mlp.up_proj.{part}"]
    save_file(tensors, qdir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=message):
        _engine(qdir)


def test_mxfp4_config_on_a_dense_model_is_refused(tiny_model: TinyModels, tmp_path: Path) -> None:
    from worker.api import UnsupportedModelError

    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, "awq")
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="mxfp4 on a llama model"):
        _engine(qdir)
