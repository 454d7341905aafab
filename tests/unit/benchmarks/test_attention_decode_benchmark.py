"""benchmarks.attention_decode's CPU smoke run: every method (the Triton kernels under
the interpreter, split-KV and one-pass; FlexAttention's paged decode; SDPA) gives SDPA's
output on the same keys, values and queries, and the RESULT line has each one's GB/s."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[3]
METHODS = {"sdpa_contiguous", "triton_split", "triton_one_pass", "flex_paged"}


def test_tiny_run_every_method_agrees_with_sdpa() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_decode", "--tiny", "--iters", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if re.match(r"\s+\d+\s+[a-z_]+\s+[\d.]+\s", ln)]
    assert {(int(r[0]), r[1]) for r in rows} == {(b, m) for b in (1, 3) for m in METHODS}
    assert all(float(r[4]) < 1e-5 for r in rows), rows
    result = proc.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    for b in (1, 3):
        for m in METHODS:
            assert f"gbps_b{b}_{m}=" in result
        assert f"split_over_one_pass_b{b}=" in result
