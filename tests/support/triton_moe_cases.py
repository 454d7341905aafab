"""Runs the Triton fused-MoE kernel (worker/model/moe_triton.py) under Triton's
interpreter on CPU and saves its outputs beside the torch path's, for
tests/unit/worker/models/test_moe_triton.py.

    TRITON_INTERPRET=1 python -m tests.support.triton_moe_cases OUT.pt

A separate process: Triton decides interpret-or-compile when triton.language is first
imported (see tests/support/triton_interpret_cases.py).
"""
from __future__ import annotations

import os
import sys

import torch

from worker.model.moe import MoEActivation, grouped_experts_torch, softmax_topk

# name -> (tokens, experts, top_k, intermediate, activation, bias)
CASES: dict[str, tuple[int, int, int, int, str, bool]] = {
    "one_token": (1, 4, 2, 32, "silu", False),
    "decode_batch": (5, 8, 2, 32, "silu", False),
    "prefill_many_blocks": (70, 8, 2, 48, "silu", False),  # 140 pairs: 64-row blocks, some groups span two
    "prefill_big_blocks": (200, 4, 2, 32, "silu", False),  # 400 pairs over 4 experts: groups of several blocks
    "top4_odd_sizes": (23, 6, 4, 24, "silu", False),
    "gpt_oss_bias_clamp": (33, 4, 2, 32, "swiglu_clamp", True),
}
SKEWED = "skewed"  # every token to experts 3 and 1: the other blocks are empty


def run_case(
    num_tokens: int, num_experts: int, top_k: int, inter: int, activation: str, bias: bool, skewed: bool = False,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    from worker.model.moe_triton import align_by_expert, fused_experts

    g = torch.Generator().manual_seed(num_tokens)
    hidden = 64
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    b13 = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) if bias else None
    ids, weights = softmax_topk(torch.randn(num_tokens, num_experts, generator=g), top_k, True)
    if skewed:
        ids = torch.tensor([[3, 1]] * num_tokens)
    act = MoEActivation(activation)
    x, w13, w2, ids, weights = (t.to(device) for t in (x, w13, w2, ids, weights))
    b13, b2 = (None if t is None else t.to(device) for t in (b13, b2))
    sorted_pairs, block_expert = align_by_expert(ids, num_experts, 16)
    return {
        "kernel": fused_experts(x, w13, w2, ids, weights, act, b13, b2),
        "torch": grouped_experts_torch(x, w13, w2, ids, weights, act, b13, b2),
        "ids": ids,
        "sorted_pairs": sorted_pairs,
        "block_expert": block_expert,
    }


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    results = {name: run_case(*spec) for name, spec in CASES.items()}
    results[SKEWED] = run_case(20, 8, 2, 32, "silu", False, skewed=True)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
