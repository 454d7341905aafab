"""Runs the int4 dequantizing GEMM (worker/model/quant/int4_gemm.py) under Triton's
interpreter on CPU next to the torch reference, for tests/unit/worker/models/test_int4_gemm.py.

    TRITON_INTERPRET=1 python -m tests.support.triton_int4_cases OUT.pt
"""
from __future__ import annotations

import os
import sys

import torch

from worker.model.quant.int4_gemm import int4_gemm, int4_gemm_torch, pack_k_major

# (M, K, N, group): ragged M and N (tile edges), several groups per K tile and the reverse.
CASES = {"decode": (1, 64, 48, 32), "prefill": (37, 128, 80, 16), "wide_group": (20, 128, 40, 64)}


def run_case(m: int, k: int, n: int, group: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    x = torch.randn(m, k, generator=gen)
    qweight = pack_k_major(q)
    w = (q.float() - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)
    return {"kernel": int4_gemm(x, qweight, scales, zeros, group),
            "torch": int4_gemm_torch(x, qweight, scales, zeros, group), "dense": x @ w}


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    torch.save({name: run_case(*shape) for name, shape in CASES.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
