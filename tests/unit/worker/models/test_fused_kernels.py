"""The fused Triton kernels (residual add + RMSNorm, RoPE of q and k, SiLU * up) against
the torch path, on CPU under Triton's interpreter (a subprocess:
tests/support/fused_interpret_cases.py) and natively on CUDA; and the engine's greedy
outputs with them on, token for token those of transformers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.model import fused

pytest.importorskip("triton", reason="triton is not installed; fused kernels not checked")

ROOT = Path(__file__).resolve().parents[4]
PAIRS = [("norm", "norm_torch"), ("addnorm", "addnorm_torch"), ("addnorm_sum", "addnorm_sum_torch"),
         ("silu", "silu_torch"), ("rope_q", "rope_q_torch"), ("rope_k", "rope_k_torch")]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("fused") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.support.fused_interpret_cases", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] for p in PAIRS])
def test_kernel_matches_the_torch_path_in_interpreter(interpreted: dict, dtype: str, pair: tuple[str, str]) -> None:
    got, want = interpreted[dtype][pair[0]], interpreted[dtype][pair[1]]
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == "bf16":  # rounded where the torch path rounds: the same bits
        assert torch.equal(got, want)
    else:  # fp32: a reduction's order apart
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_norm_without_residual_passes_x_through_and_rope_leaves_v(interpreted: dict) -> None:
    for dtype in ("fp32", "bf16"):
        assert torch.equal(interpreted[dtype]["norm_res_passthrough"], interpreted[dtype]["x"])
        assert interpreted[dtype]["v_untouched"].item() == 1


def test_rope_writes_the_rotated_key_and_the_value_into_their_slots(interpreted: dict) -> None:
    for dtype in ("fp32", "bf16"):
        r = interpreted[dtype]
        assert torch.equal(r["write_q"], r["rope_q"])
        assert torch.equal(r["write_cache_k"], r["rope_k"])
        assert torch.equal(r["write_cache_v"], r["write_v"])
        assert r["write_elsewhere_zero"].item() == 1


@pytest.mark.parametrize("case", ["llama_torch", "qwen3_torch", "llama_triton", "mistral_swa_triton"])
def test_engine_greedy_with_fused_kernels_equals_transformers(interpreted: dict, case: str) -> None:
    """`_triton`: the Triton attention backend (interpreted) behind RoPE's own KV write."""
    got, want = interpreted["greedy"][f"{case}_engine"], interpreted["greedy"][f"{case}_hf"]
    assert want.numel() > 30
    assert torch.equal(got, want)
    # Behind the Triton backend RoPE writes the KV cache itself (every layer, every step).
    assert (interpreted["greedy"][f"{case}_kv_writes"].item() > 0) == case.endswith("_triton")


def test_cpu_tensors_take_the_torch_path_by_default() -> None:
    assert not fused.fused_on(torch.zeros(2))
    fused.set_fused_kernels(False)
    try:
        assert not fused.fused_on(torch.zeros(2))
    finally:
        fused.set_fused_kernels(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_match_the_torch_path_on_cuda() -> None:
    from tests.support.fused_interpret_cases import kernel_cases

    cases = kernel_cases(torch.bfloat16, device="cuda")
    for got, want in PAIRS:
        # Compiled, a reduction's order (or the GPU's sqrt) may move a bf16 value one ulp.
        mismatched = (cases[got] != cases[want]).float().mean().item()
        assert mismatched < 0.02, (got, mismatched)
        torch.testing.assert_close(cases[got].float(), cases[want].float(), rtol=1.6e-2, atol=1e-2)
