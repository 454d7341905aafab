"""A .gguf file's config, read wherever the project reads a model's config: the engine's
load (worker.model_config.load_hf_config) and the shape the step-time budget and
`kvserve calibrate` size with (worker.costs.shapes.load_shape) must agree, from the one
reader. Config only: no weights are loaded.

The model is SmolLM2-135M-Instruct (Q4_1; see tests/support/real_models.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.real_models import require_smollm2_gguf
from worker.config import EngineConfig, ModelConfig, SchedulerConfig
from worker.model_config import load_hf_config
from worker.costs.shapes import load_shape
from worker.scheduling.step_budget import profile_predictor

pytestmark = pytest.mark.gguf


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return require_smollm2_gguf()


def test_shape_of_a_gguf_file_is_its_config(gguf_path: Path) -> None:
    config = load_hf_config(gguf_path)
    shape = load_shape(str(gguf_path))
    assert shape.name == gguf_path.stem
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.vocab_size) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
        config.num_key_value_heads, config.vocab_size,
    )
    assert shape.tie_word_embeddings == config.tie_word_embeddings


def test_step_time_budget_predicts_for_a_gguf_model(gguf_path: Path) -> None:
    """build_engine builds this predictor before any weights load."""
    predictor = profile_predictor(EngineConfig(
        model=ModelConfig(str(gguf_path), device="cpu", step_time_profile="h200"),
        scheduler=SchedulerConfig(max_step_time_s=0.05),
    ))
    assert predictor is not None
