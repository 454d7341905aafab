"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt token, its logprob and the
top-k alternatives, read from the prefill's own logits.

Which flat rows (one step's batch, chunked prefill included):

    prompt  p0 p1 p2 ... p(P-1)            the logits at position q predict token q+1,
    chunk        [c ........ c+n)          so a chunk contributes positions
    rows         [max(c, done) .. min(c+n, P-1))   with target token_ids[q+1]

`done` = len(seq.prompt_logprobs): entries already made (tokens 1..done). Position P-1
predicts the first output token (the sampler's business), so it is never a row here.
A preempted prefill recomputes from 0; rows below `done` are skipped, so no token gets
two entries. Prefix-cache hits never reach here: the scheduler does not read the cache for
these requests (a cached block has no logits), as vLLM does.

Batched: one lm_head call, one log_softmax, one gather, one topk over all rows of every
sequence that asked, then one host copy per result tensor. A long prefill chunk is cut
into slices of at most MAX_SLICE_ELEMENTS logits (rows x vocabulary), so that a 2k-token
chunk of a 128k vocabulary never holds GBs of fp32 logits at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.api import TokenLogprob
from worker.sequence import Sequence


@dataclass(frozen=True)
class PromptLogprobRows:
    """The rows of one step: flat token indices, their target tokens, and per asking
    sequence the slice of rows that is its (plan index, lo, hi)."""

    flat_idx: list[int]
    targets: list[int]
    owners: list[tuple[int, int, int]]


def rows_for_step(
    seqs: list[Sequence], num_new_tokens: list[int], order: list[int], query_start: list[int]
) -> PromptLogprobRows | None:
    """`order[row]` is the plan index of the row-th sequence in the flat batch, which
    starts at flat token `query_start[row]`."""
    flat_idx: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int, int]] = []
    for row, i in enumerate(order):
        seq = seqs[i]
        done = seq.prompt_logprobs
        if done is None:
            continue
        c, n = seq.num_computed_tokens, num_new_tokens[i]
        lo, hi = max(c, len(done)), min(c + n, seq.num_prompt_tokens - 1)
        if lo >= hi or c > len(done):  # nothing new here (or a gap it cannot fill)
            continue
        first = query_start[row] + lo - c
        owners.append((i, len(flat_idx), len(flat_idx) + hi - lo))
        flat_idx.extend(range(first, first + hi - lo))
        targets.extend(seq.token_ids[lo + 1 : hi + 1])
    if not owners:
        return None
    return PromptLogprobRows(flat_idx, targets, owners)


MAX_SLICE_ELEMENTS = 1 << 26  # 256 MiB of fp32 logits (and as much for their log_softmax)


@torch.inference_mode()
def compute(
    rows: PromptLogprobRows,
    seqs: list[Sequence],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> None:
    """Append each asking sequence's new entries to its `prompt_logprobs`."""
    max_k = max(seqs[i].params.prompt_logprobs or 0 for i, _, _ in rows.owners)
    chosen_host: list[float] = []
    ranks_host: list[int] = []
    top_values_host: list[list[float]] = []
    top_ids_host: list[list[int]] = []
    step = max(1, MAX_SLICE_ELEMENTS // vocab_size)
    for lo in range(0, len(rows.flat_idx), step):
        chosen, ranks, top_k = _slice(
            rows.flat_idx[lo : lo + step], rows.targets[lo : lo + step], hidden, compute_logits, vocab_size, max_k
        )
        chosen_host += chosen
        ranks_host += ranks
        if top_k is not None:
            top_values_host += top_k[0]
            top_ids_host += top_k[1]
    for i, lo, hi in rows.owners:
        seq = seqs[i]
        k = seq.params.prompt_logprobs or 0
        entries = seq.prompt_logprobs
        assert entries is not None
        for r in range(lo, hi):
            top = tuple(zip(top_ids_host[r][:k], top_values_host[r][:k])) if k else ()
            entries.append(TokenLogprob(rows.targets[r], chosen_host[r], top, ranks_host[r]))


def _slice(
    flat_idx: list[int],
    targets: list[int],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    max_k: int,
) -> tuple[list[float], list[int], tuple[list[list[float]], list[list[int]]] | None]:
    """Chosen logprobs, ranks and top-k (values, ids) of some rows, on the host."""
    dev = hidden.device
    index = torch.tensor(flat_idx, dtype=torch.long).to(dev, non_blocking=True)
    target = torch.tensor(targets, dtype=torch.long).to(dev, non_blocking=True).unsqueeze(1)
    logits = compute_logits(hidden.index_select(0, index))[:, :vocab_size].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    del logits
    chosen = logprobs.gather(1, target)
    # Rank as vLLM counts it: 1 + how many tokens are strictly more likely.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = None
    if max_k > 0:
        values, ids = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
        top = (values.tolist(), ids.tolist())
    return chosen.squeeze(1).tolist(), ranks.tolist(), top
