"""The int4 dequantizing GEMM kernel (worker/model/quant/int4_gemm.py) against torch: under
Triton's interpreter on CPU (a subprocess: triton_int4_cases.py), and its packing against
GPTQ's own (the kernel reads GPTQ's qweight as is)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.quant_checkpoints import gptq
from tests.support.triton_int4_cases import CASES
from worker.model.quant.int4_gemm import int4_gemm_torch, pack_k_major
from worker.model.quant.layout import unpack_last

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    pytest.importorskip("triton", reason="triton is not installed; kernel not checked")
    out = tmp_path_factory.mktemp("int4") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.support.triton_int4_cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_torch_in_interpreter(interpreted: dict, case: str) -> None:
    r = interpreted[case]
    assert r["kernel"].shape == r["torch"].shape == (CASES[case][0], CASES[case][2])
    torch.testing.assert_close(r["kernel"], r["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["torch"], r["dense"], rtol=1e-4, atol=1e-4)


def test_gptq_qweight_is_the_kernels_layout() -> None:
    """A GPTQ file's qweight, scales and (stored + 1) zeros multiply as its dequantized weight."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    tensors, deq = gptq(w, desc_act=False)
    zeros = torch.full_like(tensors["scales"], 8, dtype=torch.float32)  # symmetric: stored 7, + 1
    x = torch.randn(3, 64)
    got = int4_gemm_torch(x, tensors["qweight"], tensors["scales"].float(), zeros, 32)
    torch.testing.assert_close(got, x @ deq.t(), rtol=1e-5, atol=1e-5)
    q = torch.randint(0, 16, (64, 48))  # the kernel's packing is the loader's unpacking, inverted
    assert torch.equal(unpack_last(pack_k_major(q).t().contiguous(), 4).t(), q)
