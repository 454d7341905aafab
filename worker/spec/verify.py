"""Verifying a step's drafts on the device: the target's logits at every position of every
verify row, in one batch, turned into each row's accepted drafts and one token of its own.

    logits rows:   row r's positions c, c+1, .., c+k  (drafts d1..dk checked at c..c+k-1,
                   the bonus drawn at c+k)
    greedy row:    accept d_j while argmax at c+j-1 == d_j; then that argmax
    sampled row:   rejection sampling (worker/spec/rejection.py) on the row's filtered
                   logits (the sampler's temperature, min_p, top_k, top_p)

A seeded request draws its uniforms and noise from its own generator, k + 1 positions at
a time, so its output depends on its seed and its own drafts only. The host reads the
accept flags and the alternatives once (`result`), after the step's other samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.sampling.sampler import Sampler
from worker.sequence import Sequence
from worker.spec.rejection import first_rejections, rejection_sample


@dataclass
class VerifyLaunch:
    """A step's verification queued on the device; `result` reads it."""

    plan_rows: list[int]  # the plan index of each verify row
    drafts: list[list[int]]
    offsets: list[int]  # each row's first logits row
    accepted: torch.Tensor  # (N,) bool
    alt: torch.Tensor  # (N,) long

    def result(self) -> dict[int, list[int]]:
        """Plan index -> the row's tokens: accepted drafts, then the target's own token."""
        accepted, alt = self.accepted.tolist(), self.alt.tolist()
        num_accepted = first_rejections(accepted, self.offsets, [len(d) for d in self.drafts])
        return {i: d[:a] + [alt[o + a]]
                for i, d, o, a in zip(self.plan_rows, self.drafts, self.offsets, num_accepted)}


def launch_verify(logits: torch.Tensor, seqs: list[Sequence], plan_rows: list[int], drafts: list[list[int]],
                  sampler: Sampler) -> VerifyLaunch:
    """`logits` (sum(k_r + 1), V): the verify rows' positions in order; `seqs[r]` and
    `drafts[r]` are row r's sequence and drafts."""
    device = logits.device
    logits = logits[:, : sampler.vocab_size].float()
    counts = [len(d) + 1 for d in drafts]
    offsets = [0]
    for n in counts[:-1]:
        offsets.append(offsets[-1] + n)
    draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.long).to(device, non_blocking=True)
    best = logits.argmax(dim=-1)
    accepted, alt = best == draft_ids, best
    random = [r for r, seq in enumerate(seqs) if not seq.params.greedy]
    if random:
        positions = [offsets[r] + j for r in random for j in range(counts[r])]
        index = torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)
        row_seqs = [seqs[r] for r in random for _ in range(counts[r])]
        x = sampler.filtered(logits.index_select(0, index), row_seqs)
        uniforms, noise = _draws(sampler, [seqs[r] for r in random], [counts[r] for r in random], x)
        acc, alt_random = rejection_sample(x, draft_ids.index_select(0, index), uniforms, noise)
        accepted = accepted.index_copy(0, index, acc)
        alt = alt.index_copy(0, index, alt_random)
    return VerifyLaunch(plan_rows, drafts, offsets, accepted, alt)


def _draws(sampler: Sampler, seqs: list[Sequence], counts: list[int], like: torch.Tensor,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms (N,) and Exp(1) noise (N, V) for the sampled rows' positions: a seeded row's
    from its own generator, the rest from one batch draw."""
    uniforms = torch.rand(like.shape[0], device=like.device)
    noise = torch.empty_like(like).exponential_()
    start = 0
    for seq, n in zip(seqs, counts):  # one generator call pair per seeded row, not per token
        if seq.params.seed is not None:
            generator = sampler.generator(seq)
            uniforms[start : start + n] = torch.rand(n, device=like.device, generator=generator)
            noise[start : start + n].exponential_(generator=generator)
        start += n
    return uniforms, noise
