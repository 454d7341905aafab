"""Speculative decoding on the simulated device: the real scheduler plans verify rows with
their lookahead blocks, the cost model prices them (1 + k tokens and logits rows a row),
and acceptance follows a workload's rate instead of a model.

    drafts      k placeholder tokens for every eligible decode row (no n-gram search: the
                simulated tokens are hashes, and the rate says how many would match)
    verify      row of seq s: its next tokens t1, t2, ... are the ones the plain simulated
                device would draw one step at a time (each a hash of the history before
                it, worker/sim/runner.py); draft j is accepted while u_j < acceptance, with
                u_j a deterministic hash of the history up to it, so a run is reproducible
                and the tokens are exactly those of a run without speculation

A row yields its accepted drafts' tokens and one more, as a real verify row does.
"""
from __future__ import annotations

from collections.abc import Callable

from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # worker/sim/runner.py's history hash
_ACCEPT_SALT = 0x5EC0DEC0DE5EC0DE


class SimDraftProposer:
    """Proposes `num_tokens` placeholder drafts (the scheduler's limit applied)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        n = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        return [0] * max(n, 0)


def _unit(x: int) -> float:
    """A hash in [0, 1) (splitmix64's finaliser)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def verify_row(seq: Sequence, num_drafts: int, acceptance: float, next_token: Callable[[Sequence], int],
               token_from_state: Callable[[int, Sequence], int]) -> list[int]:
    """The tokens a verify row of `seq` with `num_drafts` drafts yields: the accepted
    drafts' tokens and one more, each the token the plain device would draw there."""
    tokens = [next_token(seq)]  # caches the history's state on the sequence
    _, state = seq.sampler_state
    for _ in range(num_drafts):
        if _unit(state ^ _ACCEPT_SALT) >= acceptance:
            break
        state = (state * _BASE + tokens[-1] + 1) & _MASK  # the history with that token appended
        tokens.append(token_from_state(state, seq))
    return tokens


def verify_rows(plan: SchedulerOutput, acceptance: float, next_token: Callable[[Sequence], int],
                token_from_state: Callable[[int, Sequence], int]) -> dict[int, list[int]]:
    """Each verify row's tokens, by plan index (RunnerOutput.verified_token_ids)."""
    drafts = plan.draft_token_ids
    return {i: verify_row(seq, len(drafts[seq.request_id]), acceptance, next_token, token_from_state)
            for i, seq in enumerate(plan.seqs) if seq.request_id in drafts}
