"""The KV paths every family must keep: disaggregation (prefill on one engine, KV export,
import and decode on another) and the host / disk tiers, on gpt-oss (sinks, a window,
alternating layers) and Qwen3-MoE: greedy tokens equal transformers' either way.
Reuses test_disagg_engine.py's and test_kv_tiers_vs_hf.py's workloads and helpers."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.unit.worker.kvcache import test_disagg_engine as disagg
from tests.unit.worker.kvcache import test_kv_tiers_vs_hf as tiers

if TYPE_CHECKING:
    from tests.conftest import HFReference
    from tests.unit.worker.models.conftest import TinyMoEModels

FAMILIES = ["gpt_oss", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_disaggregated_decode_matches_transformers(
    family: str, tiny_moe: TinyMoEModels, moe_reference: HFReference
) -> None:
    model_dir = tiny_moe(family)
    prefill, decode = disagg._engine(model_dir), disagg._engine(model_dir)
    tokens, cached = disagg._disaggregated(prefill, decode, [[0, 1, 2, 3, 4], [5]])
    assert cached["5"] == 2 * disagg.BLOCK  # the prefill side's prefix cache served the shared prefix
    reference = moe_reference(family, disagg.PROMPTS, disagg.MAX_TOKENS)
    assert [tokens[str(i)] for i in range(len(disagg.PROMPTS))] == reference
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks and engine.num_pinned_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["host", "disk"])
def test_prefix_from_a_tier_matches_transformers(
    family: str, path: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable,
    tmp_path: Path,
) -> None:
    """The conversation's prefix is pushed off a 16-block pool to the host (or on to disk)
    and loaded back for the later turns, which chunk and preempt."""
    model_dir = tiny_moe(family)
    block_bytes = tiers._engine(model_dir, 16).runner.kv_spec.bytes_per_block
    if path == "host":
        engine = tiers._engine(model_dir, 16, host_bytes=64 * block_bytes)
    else:
        engine = tiers._engine(model_dir, 16, host_bytes=2 * block_bytes, disk_dir=tmp_path / "kv")
    finals: dict = {}
    outputs = tiers._turns(engine, run_engine, finals=finals)
    expected = moe_reference(family, tiers.LATER, tiers.LATER_MAX_TOKENS)
    assert outputs == {f"later{i}": out for i, out in enumerate(expected)}
    assert finals["later0"].num_cached_tokens == len(tiers.PREFIX)
    loaded = engine.tiers.num_loaded_blocks if path == "host" else engine.tiers.num_disk_loaded_blocks
    assert loaded >= 5 and engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.tiers.close()
