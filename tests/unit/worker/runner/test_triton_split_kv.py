"""Split-KV (flash-decoding) decode attention against a dense fp64 reference and the
one-pass kernel, on CPU under Triton's interpreter (a subprocess:
tests/support/triton_split_kv_cases.py): contexts at and around the split boundaries,
GQA groups of 1, 3 and 4, sliding windows, sinks, more splits than tiles. And the split
count: a function of the batch's shape alone, so a CUDA graph bucket keeps its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.triton_split_kv_cases import CASES
from worker.attention import triton_split_kv
from worker.attention.triton_split_kv import MAX_SPLITS, decode_splits

pytest.importorskip("triton", reason="triton is not installed; split-KV kernel not checked")

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("split_kv") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.support.triton_split_kv_cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_kv_matches_dense_and_one_pass_in_interpreter(interpreted: dict, case: str) -> None:
    r = interpreted[case]
    assert not torch.isnan(r["split"]).any(), "an output element was never written, or a stray block was read"
    torch.testing.assert_close(r["split"], r["reference"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["split"], r["one_pass"], rtol=1e-5, atol=1e-5)


def test_split_count_depends_on_the_batch_shape_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert decode_splits(1, 8, torch.device("cpu")) == 1  # off CUDA: the one-pass kernel
    monkeypatch.setattr(triton_split_kv, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert decode_splits(1, 8, cuda) == MAX_SPLITS  # 8 programs on 132 SMs: split all the way
    assert decode_splits(8, 8, cuda) == 5  # 64 programs: ceil(264 / 64)
    assert decode_splits(32, 8, cuda) == 1  # 256 programs fill the device
    assert decode_splits(64, 8, cuda) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["gqa4_s4", "gqa4_s4_window70", "gqa4_s2_window5_sinks", "gqa4_s16"])
def test_split_kv_compiled_on_cuda_in_bf16(case: str) -> None:
    from tests.support.triton_split_kv_cases import run_case

    r = run_case(*CASES[case], device="cuda", dtype=torch.bfloat16)
    assert not torch.isnan(r["split"]).any()
    torch.testing.assert_close(r["split"], r["one_pass"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(r["split"], r["reference"], rtol=5e-2, atol=5e-2)
