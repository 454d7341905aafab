"""The next step's plan, made while the device runs this one, when it can only be decodes.

Schedule N+1 sits on the overlapped loop's critical path (worker/scheduling/step_overlap.py): it
needs step N's sampled tokens, because which sequences still run depends on their stop
checks. In a busy replica's steady state, though (every running sequence decodes, nothing
waits or loads), the plan it will make is known before those tokens are: every running
sequence, one token each, in admission order, its block table grown to hold that token.
Only which sequences stop is unknown. So while step N is on the device the engine makes
that plan, blocks allocated ahead, and schedule N+1 takes it, minus the sequences that
stopped, if the state it was made for still holds:

    window N (device busy):  ahead = [(s1, table1), (s2, table2), (s3, table3)]
                             each table grown to len(token_ids) + 1 tokens
    update N (after wait):   s2 samples EOS -> finished, its table freed with its blocks
    schedule N+1:            nothing waits or loads, every running sequence is one token
                             behind its end -> plan [s1, s3], one token each
                             (anything else: the full schedule, as if no plan were made)

Taking it gives the plan the full schedule gives: the same rows in the same order with
the same block-table lists (the full schedule finds the tables already grown and
allocates nothing). Only which free block a grown table got may differ, because it was
taken before the stopped sequences freed theirs; no token depends on a block's id.
"""
from __future__ import annotations

from collections import deque

from kv.cache_manager import KVCacheManager
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus


class DecodeAhead:
    """One plan made ahead: the sequences of the step on the device, their tables grown."""

    __slots__ = ("seqs", "block_ids")

    def __init__(self, seqs: list[Sequence], block_ids: list[list[int]]) -> None:
        self.seqs = seqs
        self.block_ids = block_ids

    @classmethod
    def make(cls, running: list[Sequence], waiting: deque[Sequence], loading: list[Sequence],
             kv: KVCacheManager, max_num_batched_tokens: int) -> DecodeAhead | None:
        """The next plan if it can only be decodes: nothing waits or loads, and the step on
        the device (already advanced) takes every running sequence to its end, so each
        samples a token and decodes next. None otherwise, or when a table cannot grow
        (the full schedule then decides whom to preempt; tables grown so far stay grown,
        as the full schedule would grow them first too)."""
        if waiting or loading or not running or len(running) > max_num_batched_tokens:
            return None
        held, is_running = kv.held_block_ids, SequenceStatus.RUNNING
        tables: list[list[int]] = []
        for seq in running:
            num_tokens = len(seq.token_ids)
            if seq.status is not is_running or seq.num_computed_tokens != num_tokens:
                return None  # a prompt chunk short of its end: prompt work next step
            total = num_tokens + 1  # the token step N samples, computed by step N+1
            table = held(seq.request_id, total)
            if table is None:
                if not kv.can_allocate(seq.request_id, total):
                    return None
                table = kv.allocate(seq.request_id, total)
            tables.append(table)
        return cls(list(running), tables)

    def take(self, running: list[Sequence], waiting: deque[Sequence],
             loading: list[Sequence]) -> SchedulerOutput | None:
        """The plan, if nothing changed but stops and aborts since it was made; else None."""
        if waiting or loading:
            return None
        out = SchedulerOutput()
        seqs, tables = out.seqs, out.block_ids
        is_running = SequenceStatus.RUNNING
        for seq, table in zip(self.seqs, self.block_ids):
            if seq.status is not is_running:  # stopped or aborted since
                continue
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                return None  # its step failed or sampled nothing: not a decode
            seqs.append(seq)
            tables.append(table)
        if not seqs or len(seqs) != len(running):
            return None
        out.num_new_tokens = [1] * len(seqs)
        return out
