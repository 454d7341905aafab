"""Attention sinks (gpt-oss) in the paged backends: the torch backend against transformers'
eager arithmetic on random paged batches (decodes, fresh prompts, chunks with cached
context, windows); the Triton kernel against both under Triton's interpreter (in a
subprocess, tests/support/triton_sink_cases.py); flash is never given a model with sinks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.triton_sink_cases import CASES, dense_with_sinks, sinks_for
from tests.unit.worker.test_attention import D, _build_batch
from worker.attention import select_backend
from worker.attention.torch_paged import TorchPagedAttention

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_backend_matches_eager_sinks(case: str) -> None:
    specs, window = CASES[case]
    q, k, v, kv_cache, meta, _ = _build_batch(specs, torch.device("cpu"), 0, window)
    sinks = sinks_for()
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5, window, sinks=sinks)
    torch.testing.assert_close(out, dense_with_sinks(q, kv_cache, meta, D**-0.5, sinks, window), rtol=1e-5, atol=1e-5)


def test_very_negative_sinks_are_plain_attention() -> None:
    specs, _ = CASES["mixed"]
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cpu"))
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flash_is_never_chosen_for_sinks() -> None:
    with pytest.raises(ValueError, match="attention sinks"):
        select_backend("flash", torch.device("cpu"), needs_sinks=True)
    assert select_backend("auto", torch.device("cpu"), needs_sinks=True).supports_sinks


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    pytest.importorskip("triton", reason="triton is not installed; kernel not checked")
    out = tmp_path_factory.mktemp("triton_sinks") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_sink_cases", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_kernel_sinks_in_interpreter(interpreted: dict[str, dict[str, torch.Tensor]], case: str) -> None:
    r = interpreted[case]
    torch.testing.assert_close(r["kernel"], r["torch"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["kernel"], r["reference"], rtol=1e-4, atol=1e-4)
