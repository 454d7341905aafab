"""Runs the split-KV decode kernel (worker/attention/triton_split_kv.py) under Triton's
interpreter on CPU, with the one-pass kernel and a dense reference beside it, for
tests/unit/worker/runner/test_triton_split_kv.py.

    TRITON_INTERPRET=1 python -m tests.support.triton_split_kv_cases OUT.pt

A separate process: see tests/support/triton_interpret_cases.py.
"""
from __future__ import annotations

import os
import sys

import torch

from worker.attention.base import AttentionMetadata

BLOCK = 16  # block size; the kernel's key tile (BLOCK_N) is then 64 keys
D = 32
# Contexts at and around where a split's range changes (chunk = cdiv(cdiv(ctx, S), 64) * 64)
# for S = 2, 3, 4, and short ones whose later splits are empty; a padded row (context 1).
CONTEXTS = [1, 2, 63, 64, 65, 127, 128, 129, 192, 193, 256, 257, 385]
# name: (q heads, kv heads, splits, window, sinks)
CASES: dict[str, tuple[int, int, int, int | None, bool]] = {
    "gqa4_s2": (8, 2, 2, None, False),
    "gqa4_s3": (8, 2, 3, None, False),
    "gqa4_s4": (8, 2, 4, None, False),
    "mha_s2": (2, 2, 2, None, False),
    "gqa3_s3": (6, 2, 3, None, False),  # a group that is not a power of two
    "gqa4_s4_window70": (8, 2, 4, 70, False),
    "gqa4_s3_window200": (8, 2, 3, 200, False),
    "gqa4_s4_sinks": (8, 2, 4, None, True),
    "gqa4_s2_window5_sinks": (8, 2, 2, 5, True),
    "gqa4_s16": (4, 1, 16, None, False),  # more splits than most contexts have tiles
}


def dense(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
          window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Each row's one query against its whole context (the last `window` keys), fp64."""
    hq, hkv = q.shape[1], keys[0].shape[1]
    out = torch.empty_like(q)
    for s, (k, v) in enumerate(zip(keys, values)):
        k = k.double().repeat_interleave(hq // hkv, dim=1)
        v = v.double().repeat_interleave(hq // hkv, dim=1)
        if window is not None:
            k, v = k[-window:], v[-window:]
        scores = torch.einsum("hd,khd->hk", q[s].double(), k) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
        out[s] = torch.einsum("hk,khd->hd", probs, v).float()
    return out


def run_case(hq: int, hkv: int, splits: int, window: int | None, with_sinks: bool,
             device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    from worker.attention.triton_paged import paged_attention

    g = torch.Generator().manual_seed(hq * 100 + splits)
    blocks_per = [-(-c // BLOCK) for c in CONTEXTS]
    num_blocks = sum(blocks_per) + 1
    cache = torch.randn(2, num_blocks, BLOCK, hkv, D, generator=g)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 never used: a stray read shows
    cache[:, 0] = float("nan")
    width = max(blocks_per)
    table = torch.zeros(len(CONTEXTS), width, dtype=torch.int32)
    keys, values, at = [], [], 0
    for s, (ctx, nb) in enumerate(zip(CONTEXTS, blocks_per)):
        ids = order[at : at + nb]
        at += nb
        table[s, :nb] = ids.int()
        keys.append(cache[0, ids].reshape(-1, hkv, D)[:ctx])
        values.append(cache[1, ids].reshape(-1, hkv, D)[:ctx])
    q = torch.randn(len(CONTEXTS), hq, D, generator=g)
    sinks = torch.randn(hq, generator=g) * 2.0 if with_sinks else None
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(CONTEXTS), dtype=torch.long), num_decode_tokens=len(CONTEXTS),
        cu_seqlens_q=torch.arange(len(CONTEXTS) + 1, dtype=torch.int32),
        seqused_k=torch.tensor(CONTEXTS, dtype=torch.int32), block_table=table,
        max_query_len=1, max_context_len=max(CONTEXTS),
    )
    scale = D**-0.5
    result = {"reference": dense(q, keys, values, scale, window, sinks)}
    q, cache = q.to(device, dtype), cache.to(device, dtype)
    sinks = sinks.to(device) if sinks is not None else None
    meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device), num_decode_tokens=meta.num_decode_tokens,
        cu_seqlens_q=meta.cu_seqlens_q.to(device), seqused_k=meta.seqused_k.to(device),
        block_table=meta.block_table.to(device), max_query_len=1, max_context_len=meta.max_context_len,
    )
    for name, n in (("split", splits), ("one_pass", 1)):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, cache[0], cache[1], meta, scale, out=out, sliding_window=window, sinks=sinks,
                        num_splits=n)
        result[name] = out.float().cpu()
    return result


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (this runs kernels on CPU tensors)")
    torch.save({name: run_case(*spec) for name, spec in CASES.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
