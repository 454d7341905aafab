"""Sliding-window attention (Mistral; Qwen2's use_sliding_window / max_window_layers) is
token-for-token transformers' greedy `generate`, with a window (24) shorter than the
prompts and prompt + output crossing it, however the engine batches and chunks.

Runs the same prompt set and helpers as test_engine_vs_hf.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kv.cache_manager import cdiv
from tests.support.tiny_models import SLIDING_WINDOW
from tests.unit.worker.models.test_engine_vs_hf import ALL, CHUNKED, MAX_TOKENS, PROMPTS, _assert_free, _engine, _expected, _greedy, _run
from worker.model.llama import LlamaArch
from worker.model_config import load_hf_config

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels

FAMILIES = ["mistral_swa", "qwen2_swa"]


@pytest.mark.parametrize("family,windows", [
    ("mistral_swa", (SLIDING_WINDOW, SLIDING_WINDOW)),
    ("qwen2_swa", (None, SLIDING_WINDOW)),  # layers from max_window_layers=1 on slide
])
def test_layer_windows_follow_the_config(family: str, windows: tuple, tiny_model: TinyModels) -> None:
    assert LlamaArch.from_hf_config(load_hf_config(tiny_model(family))).sliding_windows == windows


def test_the_window_is_shorter_than_the_prompts() -> None:
    crossing = [i for i in ALL if len(PROMPTS[i]) > SLIDING_WINDOW]
    assert len(crossing) > len(ALL) // 2
    assert all(len(PROMPTS[i]) + MAX_TOKENS[i] > SLIDING_WINDOW for i in CHUNKED)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_requests_cross_the_window(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_model(family))
    for i in (8, 0):  # a 120-token prompt (5 windows), a 1-token prompt decoding 64 past it
        (expected,) = hf_reference(family, [PROMPTS[i]], [MAX_TOKENS[i]])
        assert run_engine(engine, [PROMPTS[i]], _greedy(MAX_TOKENS[i])) == {"0": expected}
    _assert_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_with_prefix_cache(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_model(family))
    assert _run(run_engine, engine, ALL) == _expected(hf_reference, family, ALL)
    _assert_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_across_the_window(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    # 7-token chunks: a chunk's first queries still see keys from blocks before the window
    # of its last ones, and decodes share the steps.
    engine = _engine(tiny_model(family), max_num_batched_tokens=7)
    assert _run(run_engine, engine, CHUNKED) == _expected(hf_reference, family, CHUNKED)
    assert engine.stats().num_steps >= cdiv(sum(len(PROMPTS[i]) for i in CHUNKED), 7)
    _assert_free(engine)


@pytest.mark.parametrize("family,full_family", [("mistral_swa", "mistral"), ("qwen2_swa", "qwen2")])
def test_without_the_window_outputs_differ(family: str, full_family: str, hf_reference: HFReference) -> None:
    """The window matters for these prompts: the full-attention model with the same weights
    (same config but the window, same seed) gives other tokens, so the tests above test it."""
    i = 8
    assert hf_reference(family, [PROMPTS[i]], [MAX_TOKENS[i]]) != hf_reference(full_family, [PROMPTS[i]], [MAX_TOKENS[i]])
