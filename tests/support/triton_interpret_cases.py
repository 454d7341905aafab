"""Runs the Triton paged-attention kernel under Triton's interpreter on CPU and saves its
outputs next to the torch backend's, for tests/unit/worker/runner/test_triton_paged.py.

    TRITON_INTERPRET=1 python -m tests.support.triton_interpret_cases OUT.pt

A separate process because Triton decides interpret-or-compile when triton.language is
first imported: a pytest process that already imported triton without the variable
cannot switch (and a process with it set must not run real GPU kernels).
"""
from __future__ import annotations

import os
import sys

import torch

from tests.unit.worker.runner.test_attention import D, HKV, _build_batch
from worker.attention.torch_paged import TorchPagedAttention

# (cached_tokens, new_tokens) per sequence, decodes first, as the runner orders them.
CASES: dict[str, list[tuple[int, int]]] = {
    "fresh_prompt": [(0, 7)],
    "decodes_only": [(5, 1), (12, 1), (0, 1), (30, 1)],
    "mixed": [(9, 1), (3, 1), (0, 10), (8, 5), (4, 4)],
    "chunk_over_one_tile": [(2, 1), (20, 70)],  # 70 queries > one 32-token tile (GROUP 2)
    # Sliding windows shorter than the contexts: the key loop starts past tile 0.
    "window_mixed": [(9, 1), (40, 1), (0, 10), (17, 5), (4, 4)],
    "window_long_chunk": [(70, 1), (20, 70)],
}
# The sliding window of a case (None: full causal attention).
WINDOWS: dict[str, int | None] = {"window_mixed": 5, "window_long_chunk": 19}


# The backend (K/V write + kernel) end to end on this case; the others check the kernel only.
BACKEND_CASE = "mixed"


def run_case(
    specs: list[tuple[int, int]], with_backend: bool, seed: int = 0, sliding_window: int | None = None
) -> dict[str, torch.Tensor]:
    from worker.attention.triton_paged import TritonPagedAttention, paged_attention

    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cpu"), seed, sliding_window)
    expected = TorchPagedAttention().forward(q, k, v, kv_cache.clone(), meta, D**-0.5, sliding_window)
    # The kernel alone, on an output pre-filled with NaN: every element must be written.
    written = kv_cache.clone()
    flat = written.view(2, -1, HKV, D)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, written[0], written[1], meta, D**-0.5, out=out, sliding_window=sliding_window)
    result = {"kernel": out, "torch": expected, "reference": ref}
    if with_backend:  # writes this step's K/V into its slots, then attends
        backend_cache = kv_cache.clone()
        result["backend"] = TritonPagedAttention().forward(q, k, v, backend_cache, meta, D**-0.5, sliding_window)
        result["cache_k"] = backend_cache[0].view(-1, HKV, D)[meta.slot_mapping]
        result["k"] = k
    return result


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    torch.save(
        {name: run_case(specs, name == BACKEND_CASE, sliding_window=WINDOWS.get(name)) for name, specs in CASES.items()},
        out_path,
    )


if __name__ == "__main__":
    main(sys.argv[1])
