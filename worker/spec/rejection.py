"""Rejection sampling of draft tokens against the target model (Leviathan et al., Chen et
al.): the tokens it emits are distributed exactly as sampling the target alone would be.

Per verify position with target distribution p, draft token x drawn from q:

    accept x    with probability min(1, p(x) / q(x))
    on reject   emit a sample of the residual (p - q)+ / sum (p - q)+ and stop

For the n-gram proposer q is a point mass on x (q(x) = 1): accept with probability p(x),
and the residual is p with x removed, renormalised. The position after the last draft
(the bonus) samples p itself. Greedy rows are the limit: accept while x is the argmax.

Everything is one batch of tensor ops over every verify position of the step; which
position is the first rejection is read on the host afterwards (worker/spec/verify.py).
"""
from __future__ import annotations

import math

import torch


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logits` (N, V): each position's filtered logits (softmax = p); `draft_ids`
    (N,): the draft token checked there, -1 at a bonus position; `uniforms` (N,) in [0, 1);
    `noise` (N, V): Exp(1) draws (consumed); `draft_probs` (N, V): q, or None for a point
    mass on the draft. Returns `accepted` (N,) bool (False at bonus positions) and `alt`
    (N,) long: the residual's sample at a draft position, p's sample at a bonus one."""
    probs = target_logits.softmax(dim=-1)
    is_draft = draft_ids >= 0
    safe_ids = draft_ids.clamp(min=0).unsqueeze(1)
    p_x = probs.gather(1, safe_ids).squeeze(1)
    if draft_probs is None:
        accepted = uniforms < p_x
        # p without the draft token: its logit to -inf where a draft was checked.
        residual = target_logits.scatter(1, safe_ids, -math.inf)
        residual = torch.where(is_draft.unsqueeze(1), residual, target_logits)
    else:
        q_x = draft_probs.gather(1, safe_ids).squeeze(1)
        accepted = uniforms * q_x < p_x
        diff = (probs - draft_probs).clamp_(min=0.0)
        residual = torch.where(is_draft.unsqueeze(1), diff.log(), target_logits)
    accepted &= is_draft
    # Exponential race (as the sampler's): argmax of log-weights - log Exp(1) samples the
    # normalised weights, with no normalisation needed.
    log_noise = noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_()
    alt = (residual - log_noise).argmax(dim=-1)
    return accepted, alt


def first_rejections(accepted: list[bool], offsets: list[int], num_drafts: list[int]) -> list[int]:
    """For each verify row (its positions start at offsets[r]: num_drafts[r] drafts, then the
    bonus), how many leading drafts were accepted."""
    out = []
    for start, k in zip(offsets, num_drafts):
        a = 0
        while a < k and accepted[start + a]:  # at most k per row
            a += 1
        out.append(a)
    return out
