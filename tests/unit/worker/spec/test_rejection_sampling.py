"""Rejection sampling emits tokens distributed exactly as the target's own sampling: checked
with a chi-square test on a tiny vocabulary (many independent positions in one batch), for
the n-gram proposer's point-mass drafts and a draft model's distributions, through the
verifier with the sampler's temperature / top_k / top_p, and against plain sampling. A
wrong rule (always accepting the draft, or not removing it from the residual) fails the
same test: the test has the power to see the error it guards against."""
from __future__ import annotations

import math

import pytest
import torch

from worker.api import SamplingParams
from worker.sampling.sampler import Sampler
from worker.sequence import Sequence
from worker.spec.rejection import rejection_sample
from worker.spec.verify import launch_verify

VOCAB = 6
NUM = 200_000  # independent positions per test
Z = 3.72  # one-sided normal quantile of 1e-4


def _chi2_critical(df: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; within 1% for df >= 2)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z * math.sqrt(a)) ** 3


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the tokens' counts against `probs` (cells of expected >= 5)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected >= 5
    assert counts[~keep].sum() <= 5 * (~keep).sum()  # the near-impossible tokens stay rare
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def _emitted(logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """The first emitted token of NUM one-draft positions: the draft if accepted, else the
    residual's sample."""
    n = draft.numel()
    target = logits.expand(n, -1).clone()
    accepted, alt = rejection_sample(target, draft, torch.rand(n), torch.empty(n, VOCAB).exponential_(),
                                     q.expand(n, -1) if q is not None else None)
    return torch.where(accepted, draft, alt)


LOGITS = torch.tensor([2.0, 1.2, 0.3, -0.5, 1.9, -2.0])


@pytest.mark.parametrize("draft_token", [0, 3, 5])  # the likeliest, an unlikely and the rarest token
def test_point_mass_draft_keeps_the_target_distribution(draft_token: int) -> None:
    torch.manual_seed(draft_token)
    tokens = _emitted(LOGITS, torch.full((NUM,), draft_token), None)
    stat, df = _chi2(tokens, LOGITS.softmax(-1))
    assert stat < _chi2_critical(df), (stat, df)


def test_draft_model_distribution_keeps_the_target_distribution() -> None:
    torch.manual_seed(7)
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.1, 0.1])  # far from p on purpose
    draft = torch.multinomial(q, NUM, replacement=True)
    stat, df = _chi2(_emitted(LOGITS, draft, q), LOGITS.softmax(-1))
    assert stat < _chi2_critical(df), (stat, df)


def test_a_wrong_rule_fails_the_same_test() -> None:
    torch.manual_seed(11)
    p = LOGITS.softmax(-1)
    draft = torch.full((NUM,), 3)
    always = draft  # accepting every draft
    stat, df = _chi2(always, p)
    assert stat > _chi2_critical(df)
    # Rejecting with probability 1 - p(x) but resampling from p itself (x not removed).
    accepted = torch.rand(NUM) < p[3]
    resampled = torch.where(accepted, draft, torch.multinomial(p, NUM, replacement=True))
    stat, df = _chi2(resampled, p)
    assert stat > _chi2_critical(df), stat


def _seqs(params: SamplingParams, n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(str(i), [1, 2, 3], params)
        seq.token_ids.append(4)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, max_tokens=8),
    SamplingParams(temperature=1.3, top_k=4, max_tokens=8),
    SamplingParams(temperature=1.0, top_p=0.7, min_p=0.05, max_tokens=8),
])
def test_verifier_runs_match_the_samplers_distribution(params: SamplingParams) -> None:
    """Rows with drafts [d1, d2]: the first token follows p1 (the sampler's filtered
    distribution); given it accepted d1, the second follows p2; given d1 and d2 both
    accepted, the bonus follows p3."""
    torch.manual_seed(3)
    num_rows = NUM // 4
    sampler = Sampler(VOCAB, torch.device("cpu"))
    position_logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(2)])  # p1, p2, p3
    drafts = [0, 5]  # likely under p1, likely under p2 (flipped)
    seqs = _seqs(params, num_rows)
    logits = position_logits.repeat(num_rows, 1)
    runs = launch_verify(logits, seqs, list(range(num_rows)), [list(drafts)] * num_rows, sampler).result()
    tokens = list(runs.values())
    probs = sampler.filtered(position_logits, seqs[:3]).softmax(-1)
    first = torch.tensor([t[0] for t in tokens])
    second = torch.tensor([t[1] for t in tokens if len(t) > 1])
    third = torch.tensor([t[2] for t in tokens if len(t) > 2])
    for observed, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        assert observed.numel() > 1000
        stat, df = _chi2(observed, p)
        assert stat < _chi2_critical(df), (stat, df)
    # Against plain sampling of the same rows: both within a small total variation of p1.
    plain = sampler._sample_random(LOGITS.expand(num_rows, -1).clone(), seqs)
    tv = 0.5 * (torch.bincount(plain, minlength=VOCAB) - torch.bincount(first, minlength=VOCAB)).abs().sum() / num_rows
    assert tv < 0.01


def test_greedy_rows_accept_while_the_argmax_agrees() -> None:
    sampler = Sampler(VOCAB, torch.device("cpu"))
    seqs = _seqs(SamplingParams(temperature=0.0, max_tokens=8), 3)
    p = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(2), LOGITS])  # argmaxes 0, 5, 2, 0
    logits = torch.cat([p, p[:2], p[:3]])
    runs = launch_verify(logits, seqs, [4, 7, 9], [[0, 5, 2], [3], [0, 4]], sampler).result()
    assert runs == {4: [0, 5, 2, 0], 7: [0], 9: [0, 5]}


def test_seeded_rows_reproduce() -> None:
    """A seeded row's tokens depend on its seed and its own drafts only: the same seeds give
    the same runs step after step whatever the global generator did; different seeds differ."""
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(2)]).repeat(64, 1)

    def run() -> list[list[int]]:
        out = []
        seqs = [_seqs(SamplingParams(temperature=1.0, seed=seed, max_tokens=8), 1)[0] for seed in range(64)]
        for _ in range(3):  # the generator advances between steps, as a request's does
            out += list(launch_verify(logits, seqs, list(range(64)), [[1, 1]] * 64, sampler).result().values())
        return out

    first = run()
    torch.manual_seed(99)
    assert run() == first
    assert len({tuple(t) for t in first}) > 5
