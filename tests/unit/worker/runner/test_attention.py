"""Attention backends against a naive reference on random paged inputs."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from worker.attention import AttentionMetadata, DecodeGroup, PrefillInfo, select_backend
from worker.attention.torch_paged import TorchPagedAttention

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HQ, HKV, D = 4, 2, 16


def _reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Dense causal attention for one sequence's queries at the end of its context; with a
    window, query p sees keys p - window < k <= p (transformers' sliding-window mask)."""
    query_len = q.shape[0]
    group = HQ // HKV
    k = keys.repeat_interleave(group, dim=1)  # (L, HQ, D)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    q_pos = torch.arange(context_len - query_len, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if sliding_window is not None:
        scores = scores.masked_fill(k_pos <= q_pos - sliding_window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _build_batch(
    specs: list[tuple[int, int]], device: torch.device, seed: int = 0, sliding_window: int | None = None
):
    """specs: (cached_tokens, new_tokens) per sequence, decodes (new == 1) first."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    qs, ks, vs, slots, refs, tables = [], [], [], [], [], []
    prefills, decode_rows = [], []
    start = 0
    for cached, new in specs:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        tables.append(table)
        all_k = torch.randn(ctx, HKV, D, generator=gen)
        all_v = torch.randn(ctx, HKV, D, generator=gen)
        for pos in range(cached):  # the cached part is already in the paged cache
            b, o = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv_cache[0, b, o], kv_cache[1, b, o] = all_k[pos], all_v[pos]
        q = torch.randn(new, HQ, D, generator=gen)
        qs.append(q)
        ks.append(all_k[cached:])
        vs.append(all_v[cached:])
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, ctx)]
        refs.append(_reference(q, all_k, all_v, ctx, sliding_window))
        if new == 1:
            decode_rows.append((table, ctx))
        else:
            prefills.append(PrefillInfo(start, new, ctx, torch.tensor(table, device=device)))
        start += new
    max_blocks = max((len(t) for t, _ in decode_rows), default=1)
    # Two decode groups when there are several decodes: groups must be independent.
    groups = []
    cut = max(1, len(decode_rows) // 2) if len(decode_rows) > 1 else len(decode_rows)
    for lo, hi in ((0, cut), (cut, len(decode_rows))):
        rows = decode_rows[lo:hi]
        if rows:
            groups.append(DecodeGroup(
                lo, hi,
                torch.tensor([t + [0] * (max_blocks - len(t)) for t, _ in rows], device=device),
                torch.tensor([c for _, c in rows], device=device),
                max(c for _, c in rows),
            ))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decode_rows),
        decode_groups=groups,
        prefills=prefills,
    )
    # The varlen form of the same batch (flash backends).
    lens = torch.tensor([n for _, n in specs])
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    width = max(len(t) for t in tables)
    meta.cu_seqlens_q = cu.to(device)
    meta.seqused_k = torch.tensor([c + n for c, n in specs], dtype=torch.int32, device=device)
    meta.block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    meta.max_query_len = max(n for _, n in specs)
    meta.max_context_len = max(c + n for c, n in specs)
    meta.slot_mapping = meta.slot_mapping.to(device)
    return (torch.cat(qs).to(device), torch.cat(ks).to(device), torch.cat(vs).to(device),
            kv_cache.to(device), meta, torch.cat(refs))


@pytest.mark.parametrize("specs", [
    [(0, 7)],  # a fresh prompt
    [(5, 1), (12, 1), (0, 1)],  # decodes only, different context lengths
    [(9, 1), (3, 1), (0, 10), (8, 5), (4, 4)],  # decodes + fresh prompt + chunks with context
])
def test_torch_backend_matches_reference(specs: list[tuple[int, int]]) -> None:
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cpu"))
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# Windows shorter than the contexts: decodes past the window, a fresh prompt longer than
# it, chunks whose context starts before it (blocks skipped), a window of one key.
@pytest.mark.parametrize("sliding_window", [1, 5, 8])
@pytest.mark.parametrize("specs", [
    [(0, 13)],
    [(5, 1), (12, 1), (0, 1), (30, 1)],
    [(9, 1), (3, 1), (0, 10), (17, 5), (4, 4), (20, 12)],
])
def test_torch_backend_sliding_window_matches_reference(specs: list[tuple[int, int]], sliding_window: int) -> None:
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cpu"), sliding_window=sliding_window)
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5, sliding_window)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sliding_window_wider_than_context_is_plain_causal() -> None:
    specs = [(9, 1), (0, 10), (8, 5)]
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cpu"))
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5, 64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_torch_backend_writes_new_kv_into_its_slots() -> None:
    q, k, v, kv_cache, meta, _ = _build_batch([(3, 1), (0, 6)], torch.device("cpu"))
    TorchPagedAttention().forward(q, k, v, kv_cache, meta, D**-0.5)
    flat_k = kv_cache[0].view(-1, HKV, D)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k)


def test_auto_falls_back_to_torch_on_cpu_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.attention"):
        backend = select_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    assert "flash not used" in caplog.text and "CUDA" in caplog.text


def test_flash_requested_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="cannot be used"):
        select_backend("flash", torch.device("cpu"))


def test_unknown_backend_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_flash_backend_matches_torch_backend(sliding_window: int | None) -> None:
    flash = select_backend("auto", torch.device("cuda"))
    if flash.name != "flash":
        pytest.skip("no flash-attention package usable with this torch build")
    specs = [(9, 1), (3, 1), (0, 10), (8, 5)]
    q, k, v, kv_cache, meta, ref = _build_batch(specs, torch.device("cuda"), sliding_window=sliding_window)
    out = flash.forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache.bfloat16(), meta, D**-0.5, sliding_window
    )
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
