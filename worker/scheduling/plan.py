"""The scheduler's plan for one step (worker/scheduling/scheduler.py builds it, the runner executes it,
the scheduler applies its result), and the tier loads it starts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from worker.sequence import Sequence


class TierIndex(Protocol):
    def num_available(self, block_hashes: list[int]) -> int:
        """How many of these chained blocks, from the first, a lower tier holds."""
        ...


@dataclass
class TierLoad:
    """Blocks of `seq`'s prefix to copy from a lower tier: block_hashes[i] into device
    block block_ids[i]. They follow `seq`'s device cache hits, which end at token
    `num_computed_tokens`."""

    seq: Sequence
    block_hashes: list[int]
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    """The plan for one step: `num_new_tokens[i]` tokens of `seqs[i]`, starting at its
    `num_computed_tokens`, go into this step's flat batch."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Admitted this step with imported KV: the connector loads it before execute.
    kv_imports: list[Sequence] = field(default_factory=list)
    # (slot, adapter name): adapters to write into device slots before the step runs.
    lora_loads: list[tuple[int, str]] = field(default_factory=list)
    # Admitted this step into `loading`: the engine starts their tier copies.
    kv_loads: list[TierLoad] = field(default_factory=list)
    # How many of `preempted` made room for a better band or a key's share (the first ones).
    preempted_for_priority: int = 0
    # Scheduler.advance has moved the plan's sequences past its tokens (their
    # num_computed_tokens counts this step's); from then on a row's context is
    # num_computed_tokens - num_new_tokens[i].
    advanced: bool = False
    # Launched ahead (worker/scheduling/async_scheduler.py): every row is one decode token whose input,
    # the token at position num_computed_tokens, is the previous step's sample, not yet
    # in token_ids when the plan is launched; the runner takes it from that step's output.
    pending_inputs: bool = False
    # Speculative decoding (worker/spec/): request id -> the draft tokens its decode row
    # carries after its one input token (num_new_tokens = 1 + len(drafts)). Never in
    # token_ids until verified.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Set when the result is applied to a plan with drafts: request id -> tokens the row
    # appended (accepted drafts and the target's own token), for the step's outputs.
    num_appended: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the plan before it executes (its KV import failed, or it was
        preempted to make room)."""
        i = next(j for j, s in enumerate(self.seqs) if s is seq)
        del self.seqs[i], self.num_new_tokens[i], self.block_ids[i]
        if self.draft_token_ids:  # its drafts leave with it (it may be planned again this step)
            self.draft_token_ids.pop(seq.request_id, None)

    def samples(self, i: int) -> bool:
        """Does seqs[i] reach the end of its tokens this step (and so sample one)?"""
        seq = self.seqs[i]
        end = seq.num_computed_tokens + (0 if self.advanced else self.num_new_tokens[i])
        if self.draft_token_ids and seq.request_id in self.draft_token_ids:
            return True  # a verify row (its end counts its drafts, which token_ids lacks)
        return end == seq.num_tokens
