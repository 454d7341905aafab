"""Runs the Triton paged-attention kernel WITH attention sinks under Triton's interpreter
on CPU and saves its outputs beside the torch backend's and a dense reference's, for
tests/unit/worker/models/test_attention_sinks.py.

    TRITON_INTERPRET=1 python -m tests.support.triton_sink_cases OUT.pt

A separate process: see tests/support/triton_interpret_cases.py.
"""
from __future__ import annotations

import os
import sys

import torch

from tests.unit.worker.test_attention import D, HKV, HQ, _build_batch
from worker.attention.base import AttentionMetadata

# (cached_tokens, new_tokens) per sequence, decodes first; the window of a case (or None).
CASES: dict[str, tuple[list[tuple[int, int]], int | None]] = {
    "mixed": ([(9, 1), (3, 1), (0, 10), (8, 5), (4, 4)], None),
    "long_chunk": ([(2, 1), (20, 70)], None),
    "window_mixed": ([(9, 1), (40, 1), (0, 10), (17, 5), (4, 4)], 5),
    "window_long_chunk": ([(70, 1), (20, 70)], 19),
}


def sinks_for(seed: int = 0) -> torch.Tensor:
    """Sink logits of the HQ heads: large enough to take a real share of the softmax."""
    return torch.randn(HQ, generator=torch.Generator().manual_seed(seed)) * 2.0


def dense_with_sinks(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sinks: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """transformers' gpt-oss eager arithmetic, one sequence at a time, its keys read back
    from the paged cache (after the backend wrote this step's)."""
    out = torch.empty_like(q)
    cu, used, table = meta.cu_seqlens_q.tolist(), meta.seqused_k.tolist(), meta.block_table.long()
    block_size = kv_cache.shape[2]
    group = HQ // HKV
    for s in range(len(used)):
        lo, hi, ctx = cu[s], cu[s + 1], used[s]
        slots = table[s, torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
        k = kv_cache[0].reshape(-1, HKV, D)[slots].repeat_interleave(group, dim=1)
        v = kv_cache[1].reshape(-1, HKV, D)[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k) * scale
        q_pos = torch.arange(ctx - (hi - lo), ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        combined = torch.cat([scores, sinks.view(HQ, 1, 1).expand(HQ, hi - lo, 1)], dim=-1)
        probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def run_case(specs: list[tuple[int, int]], window: int | None) -> dict[str, torch.Tensor]:
    from worker.attention.torch_paged import TorchPagedAttention
    from worker.attention.triton_paged import TritonPagedAttention

    q, k, v, kv_cache, meta, _ = _build_batch(specs, torch.device("cpu"), 0, window)
    sinks = sinks_for()
    torch_cache = kv_cache.clone()
    expected = TorchPagedAttention().forward(q, k, v, torch_cache, meta, D**-0.5, window, sinks=sinks)
    triton_cache = kv_cache.clone()
    kernel = TritonPagedAttention().forward(q, k, v, triton_cache, meta, D**-0.5, window, sinks=sinks)
    reference = dense_with_sinks(q, torch_cache, meta, D**-0.5, sinks, window)
    return {"kernel": kernel, "torch": expected, "reference": reference}


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    torch.save({name: run_case(specs, window) for name, (specs, window) in CASES.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
