"""The MLA-vs-GQA KV measure: the engine's own pool path gives the geometry's ratio."""
from __future__ import annotations

import pytest

from benchmarks.models_mla import mla_kv_bytes_vs_gqa


def test_mla_kv_bytes_vs_gqa_is_what_the_geometry_says() -> None:
    r = mla_kv_bytes_vs_gqa()
    assert r["expected"] == (512 + 64) / (2 * 8 * 128)
    assert r["mla_kv_bytes_vs_gqa"] == r["expected"]
    assert r["mla_bytes_per_token"] == 61 * (512 + 64) * 2  # layers x latent row x bf16
    # One budget buys the inverse ratio of blocks (up to the last partial block).
    assert r["mla_blocks_vs_gqa"] == pytest.approx(1 / r["expected"], rel=1e-4)
