"""The FP8 (e4m3) KV cache at the attention level (worker/attention/kv_quant.py): the round
trip's error per element is within e4m3's bound, the KV write stores exactly the rounded
values, the torch backend reads them back exactly, and the Triton kernel (interpreted on
CPU) computes what the torch backend computes on the same FP8 cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.worker.runner.test_attention import D, HKV, _build_batch
from worker.attention.base import write_kv
from worker.attention.kv_quant import E4M3_MAX, KV_FP8_SCALE, quantize_kv, roundtrip
from worker.attention.torch_paged import TorchPagedAttention

ROOT = Path(__file__).resolve().parents[4]
# e4m3 keeps 3 mantissa bits: round to nearest errs by at most half a unit in the last
# place, 2**-4 of |x| for normals (|x| >= 2**-6 * scale), 2**-10 * scale for subnormals.
REL_BOUND, SUBNORMAL_BOUND = 2.0**-4, 2.0**-10 * KV_FP8_SCALE


def test_round_trip_error_per_element_is_within_e4m3_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.pow(10.0, torch.empty(200_000).uniform_(-5, 2.9, generator=gen))
    x = magnitudes * torch.randn(200_000, generator=gen).sign()
    err = (roundtrip(x) - x).abs()
    bound = torch.maximum(x.abs() * REL_BOUND, torch.full_like(x, SUBNORMAL_BOUND))
    inside = x.abs() <= E4M3_MAX * KV_FP8_SCALE
    assert inside.sum() > 150_000 and (~inside).sum() > 1000
    assert (err[inside] <= bound[inside]).all()
    # Past the range the value saturates (never inf or NaN).
    assert torch.equal(roundtrip(x[~inside]).abs(), torch.full_like(x[~inside], E4M3_MAX * KV_FP8_SCALE))
    # The bound is tight: some element really errs by more than half of it.
    assert (err[inside] > 0.5 * bound[inside]).any()


def test_the_write_stores_the_rounded_values_and_torch_reads_them_exactly() -> None:
    q, k, v, kv_cache, meta, _ = _build_batch([(9, 1), (3, 1), (0, 10), (8, 5)], torch.device("cpu"))
    fp8 = quantize_kv(kv_cache)
    key_cache, _ = write_kv(fp8, k, v, meta.slot_mapping)
    assert key_cache.dtype == torch.float8_e4m3fn and fp8.element_size() == 1
    stored = key_cache.view(-1, HKV, D)[meta.slot_mapping].float()
    assert torch.equal(stored, roundtrip(k))
    # The torch backend on the FP8 pool == on an fp32 pool holding the same rounded values.
    got = TorchPagedAttention().forward(q, k, v, quantize_kv(kv_cache), meta, D**-0.5)
    want = TorchPagedAttention().forward(q, roundtrip(k), roundtrip(v), roundtrip(kv_cache), meta, D**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # ... and near the unrounded attention (e4m3's error, not a wrong read).
    exact = TorchPagedAttention().forward(q, k, v, kv_cache.clone(), meta, D**-0.5)
    assert (got - exact).abs().max() < 0.1 and not torch.equal(got, exact)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    pytest.importorskip("triton", reason="triton is not installed; kernel not checked")
    out = tmp_path_factory.mktemp("triton-fp8") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.support.triton_fp8_cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", ["mixed", "window_mixed", "chunk_over_one_tile"])
def test_triton_kernel_reads_the_fp8_cache_as_torch_does(interpreted: dict, case: str) -> None:
    r = interpreted[case]
    assert torch.equal(r["cache"], r["torch_cache"])  # the same bytes written
    torch.testing.assert_close(r["triton"], r["torch"], rtol=1e-4, atol=1e-4)
