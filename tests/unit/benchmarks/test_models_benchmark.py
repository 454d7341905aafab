"""benchmarks/models.py at its tiniest settings: every served family is greedy-exact in one
mixed batch, each figure is logged beside its expected value, and the RESULT line has the
issue's shape."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.models import parse_args, run
from benchmarks.models_exact import served_families
from tests.support.tiny_moe import make_tiny_moe

RESULT = re.compile(
    r"^RESULT families_exact=(\d+)/(\d+) moe_engine_vs_hf_static=(nan|\d+\.\d{2}) "
    r"mla_kv_bytes_vs_gqa=(\d+\.\d{5}) sliding_kv_blocks_vs_full=(nan|\d+\.\d{4})$"
)


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """The benchmark sets torch's thread count for its run; later tests keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_models_benchmark_tiny(tmp_path: Path) -> None:
    moe_dir = make_tiny_moe("qwen3_moe", tmp_path / "moe")
    lines: list[str] = []
    result = run(parse_args(["--tiny", "--requests", "2", "--moe-model", str(moe_dir)]), lines.append)

    assert lines[-1] == result
    match = RESULT.match(result)
    assert match, result
    k, n = int(match[1]), int(match[2])
    assert n == len(served_families()) >= 8
    assert k == n, "\n".join(line for line in lines if "requests exact" in line)
    assert float(match[3]) > 0  # a throughput ratio was measured on both sides
    assert float(match[4]) == (512 + 64) / (2 * 8 * 128)
    assert any("moe: kvserve vs hf_static tokens: 0 of 2 requests differ" in line for line in lines)
    # Every figure's log line carries the value it is expected to take.
    for name in ("families_exact", "mla_kv_bytes_vs_gqa"):
        assert any(line.startswith(f"{name}: ") and "expected" in line for line in lines), name
    assert any(line.startswith("moe_engine_vs_hf_static: ") and "goal" in line for line in lines)
    sliding = [line for line in lines if line.startswith("sliding_kv_blocks_vs_full: ")]
    assert len(sliding) == 1
    if math.isnan(float(match[5])):
        assert "not merged" in sliding[0]
    else:
        assert "expected" in sliding[0]
