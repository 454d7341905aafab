"""Runs the Triton paged-attention backend on an FP8 (e4m3) KV cache under Triton's
interpreter on CPU, next to the torch backend on the same cache, for
tests/unit/worker/runner/test_kv_fp8.py (a process of its own: see triton_interpret_cases.py).

    TRITON_INTERPRET=1 python -m tests.support.triton_fp8_cases OUT.pt
"""
from __future__ import annotations

import os
import sys

import torch

from tests.support.triton_interpret_cases import CASES, WINDOWS
from tests.unit.worker.runner.test_attention import D, _build_batch
from worker.attention.kv_quant import quantize_kv
from worker.attention.torch_paged import TorchPagedAttention

FP8_CASES = ("mixed", "window_mixed", "chunk_over_one_tile")


def run_case(name: str) -> dict[str, torch.Tensor]:
    from worker.attention.triton_paged import TritonPagedAttention

    window = WINDOWS.get(name)
    q, k, v, kv_cache, meta, _ = _build_batch(CASES[name], torch.device("cpu"), 0, window)
    fp8 = quantize_kv(kv_cache)
    torch_out = TorchPagedAttention().forward(q, k, v, fp8.clone(), meta, D**-0.5, window)
    triton_cache = fp8.clone()
    triton_out = TritonPagedAttention().forward(q, k, v, triton_cache, meta, D**-0.5, window)
    return {"torch": torch_out, "triton": triton_out, "cache": triton_cache.view(torch.uint8),
            "torch_cache": _written(fp8.clone(), q, k, v, meta, window)}


def _written(cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object,
             window: int | None) -> torch.Tensor:
    TorchPagedAttention().forward(q, k, v, cache, meta, D**-0.5, window)
    return cache.view(torch.uint8)


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    torch.save({name: run_case(name) for name in FP8_CASES}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
