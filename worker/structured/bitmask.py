"""Token bitmasks for the constrained rows of a batch, and their application in one op.

A bitmask row has ceil(V / 32) int32 words; bit j of word w allows token 32 w + j.
Unconstrained rows are all ones, so one `where` over the whole (B, V) batch applies
every constraint at once. The masks are computed by llguidance's executor (Rust, in
parallel, without the GIL).

When to overlap (`MaskPrefetcher`): on an accelerator the host only waits while the
forward runs, so the masks are computed on a helper thread then and are ready with the
logits. On a CPU device the host IS the device: the forward already uses the cores, so a
helper thread hides nothing and its hand-off (submit, wake, result) only adds CPU work
to the step, as much as the masks of a small batch; the sampler computes them inline there.
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


def compute_bitmask(seqs: SequenceT[Any], vocab_size: int, parallel: bool = True) -> np.ndarray | None:
    """(B, ceil(V/32)) int32 for the batch, or None when no row is constrained.

    `parallel`: fill the rows on llguidance's thread pool. On a CPU device the rows are
    filled one by one on the calling thread instead: the pool's threads compete with the
    forward for the same cores, and on a loaded host waiting for them to be scheduled
    costs far more than the work they would do."""
    rows = constrained_rows(seqs)
    if not rows:
        return None
    bitmask = np.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=np.int32)
    # llguidance: after llguidance_module() gave its install hint
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

    if parallel:
        fill_next_token_bitmask_par(_executor(), [(seqs[i].grammar.matcher, i) for i in rows], bitmask)
    else:
        for i in rows:
            fill_next_token_bitmask(seqs[i].grammar.matcher, bitmask, i)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """A new tensor: `logits` with every disallowed token at -inf (one op for the batch)."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        # One numpy unpack (little-endian bit order = bit j of word w is token 32 w + j)
        # writes one byte per token in one op, where the shift-and-mask below builds int32
        # intermediates four times that size; 0/1 bytes are valid bools.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:  # the compact words cross to the device (V/8 bytes a row), unpacked there
        mask = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
        allowed = ((mask.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool().flatten(1)[:, :vocab]
    return torch.where(allowed, logits, _NEG_INF.to(logits.device))


_NEG_INF = torch.tensor(float("-inf"))


class MaskPrefetcher:
    """Computes a step's bitmask on a helper thread while the forward runs, on an
    accelerator only (see the module doc); `start` returns None otherwise and the sampler
    computes the mask itself."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.enabled = torch.device(device).type != "cpu"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-mask") if self.enabled else None

    def start(self, seqs: SequenceT[Any], vocab_size: int) -> Future[np.ndarray | None] | None:
        if self._pool is None or not constrained_rows(seqs):
            return None
        return self._pool.submit(compute_bitmask, list(seqs), vocab_size)
