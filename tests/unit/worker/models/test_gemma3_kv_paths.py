"""The KV paths Gemma 3 keeps: disaggregation (prefill on one engine, KV export in model
layer order gathered from every KV group, import into another engine's group tables,
decode there) and the host / disk tiers (one table, nothing released): greedy tokens equal
transformers' either way. Reuses test_disagg_engine.py's and test_kv_tiers_vs_hf.py's
workloads and helpers."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.unit.worker.kvcache import test_disagg_engine as disagg
from tests.unit.worker.kvcache import test_kv_tiers_vs_hf as tiers

if TYPE_CHECKING:
    from tests.unit.worker.models.conftest import GemmaReference, TinyGemma


def test_disaggregated_decode_matches_transformers(tiny_gemma: TinyGemma, gemma_reference: GemmaReference) -> None:
    model_dir = tiny_gemma("gemma3")
    prefill, decode = disagg._engine(model_dir), disagg._engine(model_dir)
    assert prefill.kv.layout.num_groups == 3  # one global and two local groups
    tokens, cached = disagg._disaggregated(prefill, decode, [[0, 1, 2, 3, 4], [5]])
    assert cached["5"] == 2 * disagg.BLOCK  # the prefill side's prefix cache served the shared prefix
    reference = gemma_reference("gemma3", disagg.PROMPTS, disagg.MAX_TOKENS)
    assert [tokens[str(i)] for i in range(len(disagg.PROMPTS))] == reference
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks and engine.num_pinned_blocks == 0


@pytest.mark.parametrize("path", ["host", "disk"])
def test_prefix_from_a_tier_matches_transformers(
    path: str, tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable, tmp_path: Path,
) -> None:
    model_dir = tiny_gemma("gemma3")
    block_bytes = tiers._engine(model_dir, 16).runner.kv_spec.bytes_per_block
    if path == "host":
        engine = tiers._engine(model_dir, 16, host_bytes=64 * block_bytes)
    else:
        engine = tiers._engine(model_dir, 16, host_bytes=2 * block_bytes, disk_dir=tmp_path / "kv")
    finals: dict = {}
    outputs = tiers._turns(engine, run_engine, finals=finals)
    expected = gemma_reference("gemma3", tiers.LATER, tiers.LATER_MAX_TOKENS)
    assert outputs == {f"later{i}": out for i, out in enumerate(expected)}
    assert finals["later0"].num_cached_tokens == len(tiers.PREFIX)
    loaded = engine.tiers.num_loaded_blocks if path == "host" else engine.tiers.num_disk_loaded_blocks
    assert loaded >= 5 and engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.tiers.close()
