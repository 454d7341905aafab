"""What speculative decoding counts: draft tokens proposed and accepted, and the rows that
verified them (the engine's stats and metrics read these totals).

    acceptance_rate = accepted / proposed                    (0.0 before any draft)
    tokens_per_row  = (accepted + verify rows) / verify rows  (each verify row also yields
                                                              one token of the target's own)
    draft_acceptance = accepted / (accepted + rows that rejected a draft)
                      the chance a draft is accepted given those before it were: a row checks
                      drafts until its first rejection, so each check is an accept or the one
                      rejection that ends the row. This is the rate the step-cost model and
                      the simulator take (worker/costs/speculation.py, worker/sim/spec.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecCounters:
    num_draft_tokens: int = 0  # proposed in rows that were verified
    num_accepted_tokens: int = 0
    num_verify_rows: int = 0  # decode rows that carried drafts and were verified
    num_rejecting_rows: int = 0  # of those, rows that rejected one of their drafts

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        """One verified row (counted when its result is applied: a row preempted or failed
        before it ran proposed nothing that counts)."""
        self.num_verify_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_rejecting_rows += num_accepted < num_drafts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def draft_acceptance(self) -> float:
        checks = self.num_accepted_tokens + self.num_rejecting_rows
        return self.num_accepted_tokens / checks if checks else 0.0

    @property
    def tokens_per_row(self) -> float:
        rows = self.num_verify_rows
        return (self.num_accepted_tokens + rows) / rows if rows else 0.0
