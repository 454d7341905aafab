"""Iteration-level scheduler: every step it builds a plan from running and waiting
sequences; the runner executes the plan; `update` applies the result.

Policy (one rule covers prefill, chunked prefill, decode and recompute: each scheduled
sequence's `num_computed_tokens` catches up with its `num_tokens`):
1. running sequences first, in admission order: each gets what it still lacks (1 token
   for a decode, the rest of the prompt for a chunked prefill) within the token budget;
   when one cannot get a block, the worst band's most recently admitted running sequence
   is preempted (worker/scheduling/preemption.py: blocks freed, requeued at the front of its band,
   recomputed later);
2. then waiting sequences in band order (worker/scheduling/bands.py: SamplingParams.priority, lower
   first, FIFO within a band, a key over its share of the band's slots passed over) fill
   what is left of the token budget with prompt chunks (chunked prefill), up to
   `max_num_seqs`, admitted only when their blocks fit. A blocked head of the queue
   blocks those behind it (no starvation), except one waiting for a LoRA slot: those
   that need no new slot pass it (_with_slot). A sequence carrying imported KV
   (`seq.kv_import`, disaggregation) is admitted by the same rule; its prompt counts as
   computed (the KV connector writes it before the step executes).
   The prompt chunks of a worse band than the best that runs or waits go after the
   better bands' decodes, chunks and waiting prompts: a better band's prefill never
   waits a step for the budget behind a worse band's.
3. with KV tiers below the device (`tiers`, worker/kvcache/tiers.py), a waiting sequence whose
   prefix continues past the device's cache in a lower tier is admitted into `loading`
   instead, and `finish_load` moves it to `running` once the engine has copied the tier
   blocks in (worker/kvcache/tier_admission.py). It takes no token budget while it loads.
The token budget is max_num_batched_tokens. Within it (worker/scheduling/prefill_caps.py): while a
better band runs or waited here lately, worse bands' prompt chunks share
worse_band_prefill_tokens a step (worker/scheduling/band_prefill.py), so a better band's request never
arrives behind a long step; with a step-time budget (`step_budget`, set by the engine when
SchedulerConfig.max_step_time_s is) each prompt chunk of a step that carries decodes gets
only the tokens that keep the step's predicted time within it (worker/scheduling/step_budget.py).
Before all, a waiting sequence that could not be admitted (no running slot or no blocks)
preempts a running one of a worse band, or of its band's key furthest over its share when
its own key is under (worker/scheduling/preemption.py, worker/scheduling/bands.py); a preempted sequence resumes
exactly.
Torch-free on purpose: it is unit-tested on its own.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from itertools import groupby

from kv.cache_manager import KVCacheManager
from worker.scheduling import bands
from worker.scheduling.band_prefill import BandPrefillLimit
from worker.scheduling.bands import KeyShares, enqueue
from worker.config import SchedulerConfig
from worker.lora.slots import LoRASlots
from worker.scheduling.prefill_caps import PrefillCaps
from worker.scheduling.preemption import make_room, may_admit, preempt_for_priority, reset_for_recompute
# TierLoad is re-exported: the tier code (worker/kvcache/tiers.py, cluster/sim/tiers.py) imports it from here.
from worker.scheduling.plan import SchedulerOutput, TierIndex, TierLoad  # noqa: F401
from worker.sequence import Sequence, SequenceStatus
from worker.scheduling.step_apply import advance_plan, append_sampled
from worker.spec.apply import append_verified
from worker.spec.drafts import Speculator
from worker.scheduling.step_budget import StepTimeBudget
from worker.kvcache.tier_admission import apply_load, num_tier_blocks, start_load


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
        # Worse bands' prompt tokens per step while a better band is in use (worker/scheduling/band_prefill.py).
        n = config.worse_band_prefill_tokens
        self.band_limit = BandPrefillLimit(n) if n else None
        self._caps = PrefillCaps(self.band_limit)
        self.lora_slots: LoRASlots | None = None  # the engine's, when LoRA is enabled
        # Speculative decoding (worker/spec/): decode rows carry draft tokens. Serial loop only.
        self.speculator: Speculator | None = None
        # Waiting sequences per (band, key), and each key's weight (worker/scheduling/bands.py).
        self._waiting_keys: Counter[tuple[int, str]] = Counter()
        self._weights: dict[str, int] = {}

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
        enqueue(self.waiting, seq, front_of_band)
        self._waiting_keys[seq.params.priority, seq.params.tenant] += 1
        self._weights[seq.params.tenant] = seq.params.tenant_weight

    def _take_waiting(self, i: int) -> Sequence:
        """Remove and return waiting[i] (the head, unless a key's share picked another)."""
        seq = self.waiting[i]
        del self.waiting[i]
        key = seq.params.priority, seq.params.tenant
        self._waiting_keys[key] -= 1
        if not self._waiting_keys[key]:
            del self._waiting_keys[key]
        return seq

    # -- planning ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.expire_retention()  # sessions past their TTL: their blocks are evictable as any
        budget = self.config.max_num_batched_tokens
        self._caps.start_step(self.running, self.waiting, self.step_budget)
        shares = self._shares()
        preempt_for_priority(out, self.waiting, self.running, shares, self.config.max_num_seqs, self.kv,
                             self._preempt)
        first, deferred = bands.split_running(self.running, self.waiting)
        budget = self._schedule_running(out, budget, first)
        stopped = False
        for band, chunks in groupby(deferred, key=lambda s: s.params.priority):
            # A worse band's prompt chunks take what the better waiting prompts leave.
            if not stopped and may_admit(out):
                budget, stopped = self._schedule_waiting(out, budget, shares, band)
            budget = self._schedule_running(out, budget, list(chunks))
        if not stopped and may_admit(out):
            self._schedule_waiting(out, budget, shares)
        return out

    def _shares(self) -> KeyShares | None:
        """Who holds the running slots, per band and key: while sequences wait and two keys
        or more have been seen (worker/scheduling/bands.py)."""
        if not self.waiting or len(self._weights) < 2:
            return None
        return KeyShares(self.running, self._waiting_keys, self._weights, self.config.max_num_seqs)

    def _schedule_running(self, out: SchedulerOutput, budget: int, seqs: list[Sequence]) -> int:
        """Plan `seqs` (running, in order) within `budget`; returns what is left of it."""
        kv, running, caps = self.kv, SequenceStatus.RUNNING, self._caps
        held = kv.held_block_ids
        spec = self.speculator
        # The plan's lists, appended in place (this loop runs once per running sequence).
        plan_seqs, plan_new, plan_blocks = out.seqs, out.num_new_tokens, out.block_ids
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not running:  # preempted earlier this step
                continue
            computed = seq.num_computed_tokens
            left = len(seq.token_ids) - computed
            if left == 1 and spec is not None and budget > 1:  # a decode that may carry drafts
                drafted = spec.plan(seq, budget, kv)
                if drafted is not None:
                    out.draft_token_ids[seq.request_id] = drafted[0]
                    plan_seqs.append(seq)
                    plan_new.append(1 + len(drafted[0]))
                    plan_blocks.append(drafted[1])
                    budget -= 1 + len(drafted[0])
                    continue
            num_new = left if left < budget else budget
            if num_new > 1:  # a prompt chunk
                num_new = caps.cap(seq, num_new, computed)
                if num_new == 0:
                    continue
            total = computed + num_new
            # Most decode steps need no new block: no check, no allocation.
            block_ids = held(seq.request_id, total)
            if block_ids is None:
                # Preempts from the tail of `running` until `seq`'s blocks fit.
                if not make_room(out, kv, self.running, seq, total, self._preempt):
                    break
                block_ids = kv.allocate(seq.request_id, total)
            if left > 1:  # prompt work (a decode has one token left): counted by the caps
                caps.planned(seq, num_new)
            plan_seqs.append(seq)
            plan_new.append(num_new)
            plan_blocks.append(block_ids)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, shares: KeyShares | None,
                          below_band: int | None = None) -> tuple[int, bool]:
        """Admit waiting sequences in order (a key's share may pick one further down its
        band) while budget, slots and blocks last, and, given `below_band`, only those of a
        better band. Returns what is left of the budget, and whether admission stopped for
        good this step (False: it reached `below_band`)."""
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            i = self._with_slot(shares.pick(self.waiting) if shares is not None else 0)
            if i is None:
                break
            seq = self.waiting[i]
            if below_band is not None and seq.params.priority >= below_band:
                return budget, False
            if seq.kv_import is not None:  # its prompt's KV arrives with it
                hits, num_computed = [], seq.kv_import.num_tokens
            elif seq.params.prompt_logprobs is not None:
                # As vLLM: a cached prefix has no logits, so such a request recomputes its
                # whole prompt (its blocks still enter the cache for others).
                hits, num_computed = [], 0
            else:
                hits = self.kv.get_computed_blocks(seq.request_id, seq.token_ids, seq.hash_root)
                num_computed = len(hits) * self.kv.block_size
                num_tier = num_tier_blocks(self.kv, self.tiers, seq, len(hits))
                if num_tier:
                    if not start_load(out, self.kv, seq, hits, num_tier):
                        break
                    self._take_waiting(i)
                    self.loading.append(seq)
                    if shares is not None:
                        shares.admitted(seq)
                    continue
            num_new = min(seq.num_tokens - num_computed, budget)
            if num_new > 1:
                num_new = self._caps.cap(seq, num_new, num_computed)
                if num_new == 0:
                    break
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
            if seq.scheduled_time is None:  # once per request, not per step (tracing, worker/serving/tracing.py)
                seq.scheduled_time = time.monotonic()
            self._take_waiting(i)
            self.running.append(seq)
            if shares is not None:
                shares.admitted(seq)
            self._add_to_plan(out, seq, num_new, block_ids)
            budget -= num_new
        return budget, True

    def _with_slot(self, i: int) -> int | None:
        """`i`, or, when waiting[i]'s LoRA adapter cannot get a device slot (every slot
        serves running sequences' adapters), the first sequence after it that needs no new
        slot (no adapter, or one already resident); None when there is none. Those may pass
        it, as in vLLM, but never take a slot from it: a slot that frees goes to the first
        in order that asks."""
        slots = self.lora_slots
        if slots is None:
            return i
        for j in range(i, len(self.waiting)):
            name = self.waiting[j].lora_name
            if name is None or slots.can_acquire(name):
                return j
        return None

    def finish_load(self, seq: Sequence, num_loaded_blocks: int) -> None:
        """Apply a tier load: its first `num_loaded_blocks` blocks hold their KV now (a short
        count: the rest failed a check or vanished, and is computed instead)."""
        if seq.status is not SequenceStatus.LOADING:
            return  # aborted while it loaded
        self.loading.remove(seq)
        apply_load(self.kv, seq, num_loaded_blocks)
        self.running.append(seq)

    def _add_to_plan(self, out: SchedulerOutput, seq: Sequence, num_new: int, block_ids: list[int]) -> None:
        self._caps.planned(seq, num_new)
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        out.block_ids.append(block_ids)

    def _preempt(self, seq: Sequence) -> None:
        """Requeue a sequence just taken out of `running` (worker/scheduling/preemption.py)."""
        reset_for_recompute(self.kv, seq, self._release_lora)
        self.num_preemptions += 1
        seq.waiting_uncached_tokens = self._uncached_tokens(seq)  # its freed blocks are cached now
        self._enqueue(seq, front_of_band=True)

    # -- applying a step's result (worker/scheduling/step_apply.py) ---------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Move every planned sequence past its tokens and register the blocks they fill:
        the half of applying a step that needs the plan alone, which the overlapped loop
        runs while the step is on the device. Blocks registered here are not hit before the
        step ends: only the next schedule, after the step's wait, admits against them."""
        advance_plan(out, self.kv)

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int | None],
               verified_token_ids: dict[int, list[int]] | None = None) -> list[Sequence]:
        """Apply a step's result (advancing the plan first if that has not been done):
        append sampled tokens (a verify row's: every token of `verified_token_ids[i]`,
        worker/spec/apply.py); finish and free the sequences that stop. Returns the
        sequences that got a token (finished ones included)."""
        advance_plan(out, self.kv)
        if out.draft_token_ids:
            assert self.speculator is not None and verified_token_ids is not None
            changed, any_finished = append_verified(out, sampled_token_ids, verified_token_ids, self.kv,
                                                    self.config.max_model_len, self._release_lora,
                                                    self.speculator.counters)
        else:
            changed, any_finished = append_sampled(out, sampled_token_ids, self.kv, self.config.max_model_len,
                                                   self._release_lora)
        if any_finished:
            running = SequenceStatus.RUNNING
            self.running = [s for s in self.running if s.status is running]
        return changed

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
        cached = (num_hits + num_tier_blocks(self.kv, self.tiers, seq, num_hits)) * self.kv.block_size
        return max(seq.num_tokens - cached, 0)

    # -- removal from outside the step (abort, failed step) ---------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence that is waiting or running now (abort / error); frees its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self._take_waiting(self.waiting.index(seq))
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
