"""Token bitmasks for the constrained rows of a batch, and their application in one op.

A bitmask row has ceil(V / 32) int32 words; bit j of word w allows token 32 w + j.
Unconstrained rows are all ones, so one masked_fill over the whole (B, V) batch applies
every constraint at once. The masks are computed by llguidance's executor (Rust, in
parallel, without the GIL), so the runner starts them before the forward and they are
ready when the logits are (`MaskPrefetcher`).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceT
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from worker.structured.grammar import llguidance_module

_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance_module().LLExecutor()
    return _EXECUTOR


def constrained_rows(seqs: SequenceT[Any]) -> list[int]:
    return [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.matcher is not None]


def compute_bitmask(seqs: SequenceT[Any], vocab_size: int) -> np.ndarray | None:
    """(B, ceil(V/32)) int32 for the batch, or None when no row is constrained."""
    rows = constrained_rows(seqs)
    if not rows:
        return None
    bitmask = np.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=np.int32)
    from llguidance.numpy import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor(), [(seqs[i].grammar.matcher, i) for i in rows], bitmask)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """A new tensor: `logits` with every disallowed token at -inf (one op for the batch)."""
    mask = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    bits = _BITS.to(logits.device)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, float("-inf"))


class MaskPrefetcher:
    """Computes a step's bitmask on a helper thread while the forward runs."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-mask")

    def start(self, seqs: SequenceT[Any], vocab_size: int) -> Future[np.ndarray | None] | None:
        if not constrained_rows(seqs):
            return None
        return self._pool.submit(compute_bitmask, list(seqs), vocab_size)
