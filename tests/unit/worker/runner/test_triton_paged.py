"""The Triton paged-attention kernel against the torch backend: on CPU under Triton's
interpreter (in a subprocess, see triton_interpret_cases.py), and on CUDA natively.

Every output element must be written: the kernel's output is pre-filled with NaN and no
NaN may remain (a NaN anywhere also fails the comparison)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.triton_interpret_cases import BACKEND_CASE, CASES, WINDOWS
from worker.attention.triton_paged import tile_shape

pytest.importorskip("triton", reason="triton is not installed (pip install triton); kernel not checked")

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("triton") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_interpret_cases", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_writes_every_element_and_matches_torch_in_interpreter(
    interpreted: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    r = interpreted[case]
    assert not torch.isnan(r["kernel"]).any(), "some output element was never written"
    torch.testing.assert_close(r["kernel"], r["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["kernel"], r["reference"], rtol=1e-4, atol=1e-4)


def test_backend_writes_new_kv_then_attends_in_interpreter(
    interpreted: dict[str, dict[str, torch.Tensor]]
) -> None:
    r = interpreted[BACKEND_CASE]
    torch.testing.assert_close(r["cache_k"], r["k"])
    torch.testing.assert_close(r["backend"], r["torch"], rtol=1e-4, atol=1e-4)


def test_tile_shape_keeps_decode_batches_to_one_tile() -> None:
    assert tile_shape(group=2, max_query_len=1) == (16, 2, 1)
    assert tile_shape(group=4, max_query_len=1)[2] == 1
    assert tile_shape(group=3, max_query_len=1)[:2] == (16, 4)  # odd groups pad to a power of 2
    block_m, group_pad, tiles = tile_shape(group=4, max_query_len=100)
    per_tile = block_m // group_pad
    assert tiles * per_tile >= 100 > (tiles - 1) * per_tile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_torch_backend_on_cuda_bf16(case: str) -> None:
    """bf16 inputs; the torch backend runs on the same (bf16-rounded) values in fp32."""
    from tests.unit.worker.runner.test_attention import D, HKV, _build_batch
    from worker.attention.torch_paged import TorchPagedAttention
    from worker.attention.triton_paged import paged_attention

    window = WINDOWS.get(case)
    q, k, v, kv_cache, meta, _ = _build_batch(CASES[case], torch.device("cuda"), sliding_window=window)
    q, k, v, kv_cache = q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache.bfloat16()
    expected = TorchPagedAttention().forward(
        q.float(), k.float(), v.float(), kv_cache.float(), meta, D**-0.5, window
    )
    flat = kv_cache.view(2, -1, HKV, D)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kv_cache[0], kv_cache[1], meta, D**-0.5, out=out, sliding_window=window)
    assert not torch.isnan(out).any(), "some output element was never written"
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
