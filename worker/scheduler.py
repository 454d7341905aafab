"""Iteration-level scheduler: every step it builds a plan from running and waiting
sequences; the runner executes the plan; `update` applies the result.

Policy (one rule covers prefill, chunked prefill, decode and recompute: each scheduled
sequence's `num_computed_tokens` catches up with its `num_tokens`):
1. running sequences first, in admission order: each gets what it still lacks (1 token
   for a decode, the rest of the prompt for a chunked prefill) within the token budget;
   when one cannot get a block, the most recently admitted running sequence is preempted
   (blocks freed, requeued at the front of `waiting`, recomputed later);
   (with priorities: the lowest band's most recently admitted goes first);
2. then waiting sequences in priority order (SamplingParams.priority, lower first, FIFO
   within a band; one band by default) fill what is left of the token budget with
   prompt chunks (chunked prefill), up to `max_num_seqs`, admitted only when their
   blocks fit. A blocked head of the queue blocks those behind it (no starvation).
   A sequence carrying imported KV (`seq.kv_import`, disaggregation) is admitted by the
   same rule; its prompt counts as computed (the KV connector writes the payload into
   its blocks before the step executes), so it only schedules its first decode token.
3. with KV tiers below the device (`tiers`, worker/kv_tiers.py), a waiting sequence whose
   prefix continues past the device's cache in a lower tier is admitted into `loading`
   instead: blocks for the whole found prefix are allocated, the plan's `kv_loads` says
   which tier blocks go into which device blocks, the engine copies them (a disk read
   runs in the background), and `finish_load` moves the sequence to `running` with the
   loaded blocks computed and cached. It takes no token budget while it loads, so the
   step runs without it; a load that comes up short leaves the rest to compute.
The token budget is max_num_batched_tokens; with a step-time budget (`step_budget`, set by
the engine when SchedulerConfig.max_step_time_s is) each prompt chunk of a step that
carries decodes gets only the tokens that keep the step's predicted time within it, priced
at its own context beside the rows planned before it (worker/step_budget.py).
Before both, a waiting head of a better band that could not be admitted (no running slot
or no blocks) preempts the lowest band's running sequences, most recent first; a preempted
sequence is recomputed and resumes exactly (its tokens are kept).
Torch-free on purpose: it is unit-tested on its own.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kv.cache_manager import KVCacheManager
from worker.config import SchedulerConfig
from worker.lora.slots import LoRASlots
from worker.sequence import Sequence, SequenceStatus
from worker.step_budget import MIN_PREFILL_TOKENS, StepTimeBudget


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
    # How many of `preempted` made room for a better priority band (the first ones).
    preempted_for_priority: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the plan before it executes (its KV import failed)."""
        i = next(j for j, s in enumerate(self.seqs) if s is seq)
        del self.seqs[i], self.num_new_tokens[i], self.block_ids[i]

    def samples(self, i: int) -> bool:
        """Does seqs[i] reach the end of its tokens this step (and so sample one)?"""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # waiting on tier copies (TierLoad), admission order
        self.tiers: TierIndex | None = None  # the engine's, when it has KV tiers
        self.num_preemptions = 0
        self.step_budget: StepTimeBudget | None = None  # the engine's, when max_step_time_s is set
        self._timed_rows: list[tuple[int, int, bool]] | None = None  # this step's, under step_budget
        self._prefill_planned = False
        self.lora_slots: LoRASlots | None = None  # the engine's, when LoRA is enabled

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def add(self, seq: Sequence) -> None:
        seq.waiting_uncached_tokens = self._uncached_tokens(seq)
        self._enqueue(seq, front_of_band=False)

    def _enqueue(self, seq: Sequence, front_of_band: bool) -> None:
        """Into `waiting`, ordered by priority band (lower value first, as vLLM's priority
        policy), FIFO within a band; a preempted sequence goes to the front of its band.
        All at one priority (the default): append / appendleft."""
        waiting, band = self.waiting, seq.params.priority
        if front_of_band:
            i = 0
            while i < len(waiting) and waiting[i].params.priority < band:
                i += 1
        else:
            i = len(waiting)
            while i > 0 and waiting[i - 1].params.priority > band:
                i -= 1
        waiting.insert(i, seq)

    # -- planning ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Under a step-time budget: the rows planned so far this step, its decodes first;
        # every prefill row is capped against them as it is planned (_time_capped). None:
        # no step-time budget, or no decode that a prefill could stall.
        self._timed_rows = self._decode_rows() if self.step_budget is not None else None
        self._prefill_planned = False
        self._preempt_for_priority(out)
        budget = self._schedule_running(out, budget)
        if len(out.preempted) == out.preempted_for_priority:  # else memory is short: do not admit more
            self._schedule_waiting(out, budget)
        return out

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting head of a better band than some running sequence takes its place when
        it could not be admitted otherwise (no running slot, or its blocks do not fit):
        the lowest band's most recently admitted sequence is preempted (recomputed later,
        so it resumes exactly where it was). Never within a band."""
        while self.waiting and self.running:
            head = self.waiting[0]
            victim = self._victim()
            if victim.params.priority <= head.params.priority:
                return
            if len(self.running) < self.config.max_num_seqs and self._fits(head):
                return
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            # For a better band, not for want of memory: admission goes on this step.
            out.preempted_for_priority += 1

    def _fits(self, seq: Sequence) -> bool:
        """Could `seq`'s whole uncomputed prompt get its blocks now (cache hits counted)?"""
        hits = [] if seq.kv_import is not None else self.kv.get_computed_blocks(seq.request_id, seq.token_ids, seq.hash_root)
        return self.kv.can_allocate(seq.request_id, seq.num_tokens, hits)

    def _victim(self) -> Sequence:
        """The running sequence to preempt first: the lowest band's most recently admitted
        (the most recently admitted of all when every band is the same)."""
        victim = self.running[-1]
        for seq in reversed(self.running):
            if seq.params.priority > victim.params.priority:
                victim = seq
        return victim

    def _decode_rows(self) -> list[tuple[int, int, bool]] | None:
        """The running decodes as cost rows (new tokens, context, samples), or None if none."""
        rows = [(1, s.num_computed_tokens, True) for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        return rows or None

    def _time_capped(self, num_new: int, context: int) -> int:
        """A prefill row's tokens within the step-time budget (worker/step_budget.py), given
        the rows planned before it; the step's first prefill always advances."""
        assert self.step_budget is not None and self._timed_rows is not None
        floor = 0 if self._prefill_planned else MIN_PREFILL_TOKENS
        n = self.step_budget.prefill_tokens(self._timed_rows, context, num_new, floor)
        if n:
            self._timed_rows.append((n, context, True))
            self._prefill_planned = True
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running, kv = self.running, self.kv
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if num_new > 1 and self._timed_rows is not None:  # a prompt chunk beside decodes
                num_new = self._time_capped(num_new, seq.num_computed_tokens)
                if num_new == 0:
                    i += 1
                    continue
            total = seq.num_computed_tokens + num_new
            # Most decode steps need no new block: no check, no allocation.
            block_ids = kv.held_block_ids(seq.request_id, total)
            if block_ids is None:
                if not self._make_room(out, seq, total):  # preempts from the tail of `running`
                    break
                block_ids = kv.allocate(seq.request_id, total)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            out.block_ids.append(block_ids)
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, out: SchedulerOutput, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the most recently admitted running sequences until `seq` can hold
        `num_tokens`; False when `seq` itself had to go."""
        while not self.kv.can_allocate(seq.request_id, num_tokens):
            victim = self._victim()  # the lowest band's most recently admitted
            self.running.remove(victim)
            if victim in out.seqs:  # planned earlier this step: out of the plan
                out.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.kv_import is not None:  # its prompt's KV arrives with it
                hits, num_computed = [], seq.kv_import.num_tokens
            elif seq.params.prompt_logprobs is not None:
                # As vLLM: a cached prefix has no logits, so such a request recomputes its
                # whole prompt (its blocks still enter the cache for others).
                hits, num_computed = [], 0
            else:
                hits = self.kv.get_computed_blocks(seq.request_id, seq.token_ids, seq.hash_root)
                num_computed = len(hits) * self.kv.block_size
                num_tier = self._num_tier_blocks(seq, len(hits))
                if num_tier:
                    if not self._admit_loading(out, seq, hits, num_tier):
                        break
                    continue
            num_new = min(seq.num_tokens - num_computed, budget)
            if num_new > 1 and self._timed_rows is not None:  # a prompt beside decodes
                num_new = self._time_capped(num_new, num_computed)
                if num_new == 0:
                    break
            if seq.lora_name is not None and not self.lora_slots.can_acquire(seq.lora_name):
                break  # every slot serves a running sequence's adapter
            if not self.kv.can_allocate(seq.request_id, num_computed + num_new, hits):
                break
            block_ids = self.kv.allocate(seq.request_id, num_computed + num_new, hits)
            if seq.lora_name is not None:
                seq.lora_slot, load = self.lora_slots.acquire(seq.lora_name)
                if load:
                    out.lora_loads.append((seq.lora_slot, seq.lora_name))
            if seq.kv_import is not None:
                out.kv_imports.append(seq)
            elif seq.num_preemptions == 0:
                self.kv.record_admission(seq.num_prompt_tokens, num_computed)
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:  # once per request, not per step (tracing, worker/tracing.py)
                seq.scheduled_time = time.monotonic()
            self.waiting.popleft()
            self.running.append(seq)
            self._add_to_plan(out, seq, num_new, block_ids)
            budget -= num_new

    def _num_tier_blocks(self, seq: Sequence, num_hits: int) -> int:
        """Blocks right after the device hits that a lower tier holds (one token is always
        left to compute)."""
        if self.tiers is None:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.kv.block_size
        hashes = self.kv.block_hashes(seq.request_id)[num_hits:max_blocks]
        return self.tiers.num_available(hashes) if hashes else 0

    def _admit_loading(self, out: SchedulerOutput, seq: Sequence, hits: list, num_tier: int) -> bool:
        """Admit `seq` into `loading` with blocks for its device hits and `num_tier` tier
        blocks after them; False when they do not fit (it stays at the queue's head)."""
        num_hits, block_size = len(hits), self.kv.block_size
        num_tokens = (num_hits + num_tier) * block_size
        if not self.kv.can_allocate(seq.request_id, num_tokens, hits):
            return False
        block_ids = self.kv.allocate(seq.request_id, num_tokens, hits)
        hashes = self.kv.block_hashes(seq.request_id)
        out.kv_loads.append(TierLoad(seq, hashes[num_hits : num_hits + num_tier],
                                     block_ids[num_hits : num_hits + num_tier]))
        seq.num_computed_tokens = num_hits * block_size
        seq.status = SequenceStatus.LOADING
        if seq.scheduled_time is None:
            seq.scheduled_time = time.monotonic()
        self.waiting.popleft()
        self.loading.append(seq)
        return True

    def finish_load(self, seq: Sequence, num_loaded_blocks: int) -> None:
        """Apply a tier load: its first `num_loaded_blocks` blocks hold their KV now (a short
        count: the rest failed a check or vanished, and is computed instead)."""
        if seq.status is not SequenceStatus.LOADING:
            return  # aborted while it loaded
        self.loading.remove(seq)
        num_computed = seq.num_computed_tokens + num_loaded_blocks * self.kv.block_size
        self.kv.cache_computed(seq.request_id, seq.token_ids, num_computed, seq.hash_root)
        if seq.num_preemptions == 0:
            self.kv.record_admission(seq.num_prompt_tokens, num_computed)
            seq.num_cached_tokens = num_computed
        seq.num_computed_tokens = num_computed
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _add_to_plan(out: SchedulerOutput, seq: Sequence, num_new: int, block_ids: list[int]) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        out.block_ids.append(block_ids)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: the KV is rebuilt from token_ids (prefix cache permitting).
        self.kv.free(seq.request_id, keep_hashes=True)
        self._release_lora(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.waiting_uncached_tokens = self._uncached_tokens(seq)  # its freed blocks are cached now
        self._enqueue(seq, front_of_band=True)

    # -- applying a step's result --------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens; finish and free the
        ones that stop. Returns the sequences that got a token (finished ones included)."""
        changed: list[Sequence] = []
        any_finished = False
        kv = self.kv
        block_size = kv.block_size
        running = SequenceStatus.RUNNING
        for seq, num_new, token_id in zip(out.seqs, out.num_new_tokens, sampled_token_ids):
            if seq.status is not running:
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + num_new
            if after // block_size > before // block_size:  # a block filled: register it
                kv.cache_computed(seq.request_id, seq.token_ids, after, seq.hash_root)
            if token_id is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            seq.token_ids.append(token_id)  # Sequence.append_token, inlined (once per token)
            changed.append(seq)
            if self._check_stop(seq, token_id):
                any_finished = True
                kv.free(seq.request_id)
                if seq.lora_slot >= 0:
                    self._release_lora(seq)
        if any_finished:
            self.running = [s for s in self.running if s.status is running]
        return changed

    def _check_stop(self, seq: Sequence, token_id: int) -> bool:
        params = seq.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        reason: str | None = None
        # A constrained output is complete when its grammar terminates (every token
        # advances the matcher, so this runs before the other checks).
        if seq.grammar is not None and seq.grammar.accept(token_id):
            reason = "stop"
        elif num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                reason = "stop"
            elif token_id in params.stop_token_ids:
                reason, seq.stop_reason = "stop", token_id
        if reason is None and (num_output >= params.max_tokens or num_tokens >= self.config.max_model_len):
            reason = "length"
        if reason is None:
            return False
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return True

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens the waiting sequences would still have to prefill: their cached
        prefix blocks do not count. What the router's work model needs: counting a queued
        request's cached prefix as work made a replica holding a popular prefix look
        backlogged by thousands of tokens it will never compute, and the router released its
        affinity for nothing. Each sequence's figure is taken when it joins the queue (one
        prefix-cache walk, its hashes memoized for admission), not per step: the engine takes
        stats after every step, and a walk over a long queue of long prompts each time would
        cost the step loop milliseconds."""
        return sum(seq.waiting_uncached_tokens for seq in self.waiting)

    def _uncached_tokens(self, seq: Sequence) -> int:
        """What admission would compute if it ran now. Imports count whole (their tokens are
        the blocks they wait for), as do prompt_logprobs requests (they skip the cache)."""
        if seq.kv_import is not None or seq.params.prompt_logprobs is not None:
            return seq.num_uncomputed_tokens
        num_hits = len(self.kv.get_computed_blocks(seq.request_id, seq.token_ids, seq.hash_root))
        cached = (num_hits + self._num_tier_blocks(seq, num_hits)) * self.kv.block_size
        return max(seq.num_tokens - cached, 0)

    # -- removal from outside the step (abort, failed step) ---------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence that is waiting or running now (abort / error); frees its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.LOADING:
            self.loading.remove(seq)
        else:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.request_id)
        self._release_lora(seq)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1
