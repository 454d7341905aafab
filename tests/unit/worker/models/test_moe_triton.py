"""The Triton fused-MoE kernel against the torch grouped path: on CPU under Triton's
interpreter (in a subprocess, tests/support/triton_moe_cases.py), and on CUDA natively."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.triton_moe_cases import CASES, SKEWED

pytest.importorskip("triton", reason="triton is not installed (pip install triton); kernel not checked")

ROOT = Path(__file__).resolve().parents[4]
BLOCK_M = 16


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("triton_moe") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_moe_cases", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", sorted([*CASES, SKEWED]))
def test_kernel_matches_torch_in_interpreter(interpreted: dict[str, dict[str, torch.Tensor]], case: str) -> None:
    r = interpreted[case]
    torch.testing.assert_close(r["kernel"], r["torch"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted([*CASES, SKEWED]))
def test_alignment_puts_each_pair_once_in_its_experts_block(
    interpreted: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    r = interpreted[case]
    flat = r["ids"].reshape(-1)
    num_pairs, num_experts = flat.numel(), int(r["block_expert"].max())
    pairs = r["sorted_pairs"].long()
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))
    block_of_row = torch.arange(pairs.numel()) // BLOCK_M
    experts_of_rows = r["block_expert"].long()[block_of_row]
    assert torch.equal(experts_of_rows[real], flat[pairs[real]])
    # Blocks are in expert order; the ones past the last group are marked E and hold no pair.
    assert torch.equal(r["block_expert"], r["block_expert"].sort().values)
    assert not real[experts_of_rows >= num_experts].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_torch_on_cuda(case: str) -> None:
    from tests.support.triton_moe_cases import run_case

    r = run_case(*CASES[case], device="cuda")
    torch.testing.assert_close(r["kernel"], r["torch"], rtol=1e-4, atol=1e-4)
