"""Async scheduling: the host plans and applies steps while the device runs them (vLLM v1's
async scheduling, SGLang's overlap scheduler), as one extension of the Scheduler. Three
degrees, each used when it holds:

1. Overlapped step (any runner that overlaps the device, `worker/engine/overlap.py`): while
   the device runs step N the host publishes step N-1's outputs.
2. Plan ahead: when step N+1 can only be decodes, its plan is made while N runs.
3. Launch ahead: that plan is launched before N's tokens are back.

## The overlapped step

A runner that overlaps (`overlaps()`, worker/engine/overlap.py) splits `execute(plan)` into `launch(plan)`,
which returns as soon as the step is on the device, and `wait(handle)`, which returns its
RunnerOutput once the device is done. The async engine's step thread then runs:

    host    ..| wait N-1 | update N-1 | schedule N | launch N | advance N, outputs N-1, publish, stats, inbox, plan N+1 | wait N |...
    device  ..== N-1 ===|          (idle)                     |=================== step N ===================|

    exposed host time per step: update (the sampled tokens: append, stop checks, frees) +
            schedule (taking the plan made ahead, when there is one) + launch's host part
    hidden: advancing step N's sequences past its tokens and registering the blocks they
            fill (Scheduler.advance: the plan alone decides it), building step N-1's
            RequestOutputs, publishing them, the stats and prefix-hash snapshots, draining
            the inbox (adds, aborts, KV releases), and, when step N+1 can only be decodes,
            its plan (plan ahead, below); beyond the device step they become
            exposed too (wait then finds the device already done)

The rules, and why:
- update N-1 stays on the critical path, and so does schedule N unless it was made ahead:
  step N's decodes take as input the tokens step N-1 sampled, and which sequences still
  run depends on N-1's stop checks. When nothing waits or loads and every running
  sequence decodes next, the plan is known but for those stops: it is made under step
  N-1, and schedule N only leaves out the sequences that stopped (plan ahead, below;
  not while a KV export is due, whose pin would hold the block grown ahead). On a runner
  that can take those tokens from the device, that plan is launched before N-1 is even
  waited for, and update and schedule leave the critical path too (launch ahead, below).
- advance N runs right after launch N: the runner has taken the plan's inputs by then,
  and nothing before wait N reads a planned sequence's num_computed_tokens (outputs and
  stats read tokens and counts). Blocks it registers in the prefix cache are still being
  written by the device, but only schedule N+1, after wait N, can admit against them.
- Step N-1's outputs are built after schedule N has run, from the state update N-1 left:
  nothing on the step thread touches a sequence in between except schedule N, whose
  preemptions only show in an output's num_preemptions (the count when it is published).
- The inbox is drained while step N is on the device. An abort frees the sequence's blocks
  while a plan that holds them is in flight; that is safe because no plan can take them
  before schedule N+1, which follows wait N, and update N skips the finished sequence (its
  token is dropped).
- A launch that fails is reported by complete_step, after step N-1's outputs are built,
  so that no request receives its error before the token it sampled the step before.
- A runner that computes on the host itself (a CPU device, a test's fake) does not
  overlap: there, step N+1's launch would run the whole step before step N's outputs
  leave, delaying every output by a step. The engine's serial `step()` serves them.

## Plan ahead

Schedule N+1 sits on the overlapped loop's critical path (above): it
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

## Launch ahead

The overlapped loop (above) hides everything but update N and schedule
N+1: the device idles while they run. When the plan for N+1 was made ahead (every running
sequence decodes one token: plan ahead) and the runner can take a row's input
token from the previous step's output on the device (`launches_ahead`), step N+1 is
launched before waiting for N, and nothing is left on the critical path:

    host    | launch N+1 | wait N | update N, advance N+1, outputs N, inbox, plan N+2, launch N+2 | wait N+1 |
    device  |=========== N ======|=========== N+1 (queued behind N) ===========================|== N+2 ==

    a row of plan N+1:  token_ids [ ... L-1 ]  + pending token L (N's sample, on the device)
                        num_computed_tokens = L  (advance N),  computes position L, samples L+1

The rules, and why:
- Only the steady state: nothing waits, loads, compiles or exports, and no sequence has a
  grammar (its mask for N+1 needs the matcher past token N) or a thinking budget that may
  force N+1's token (worker/sampling/thinking.py). Anything else falls back to
  the overlapped step, whose full schedule runs with no step in flight.
- A sequence whose pending token is its last by length (max_tokens, the model's length)
  is left out: that stop is known before the token is. One that stops on EOS or a stop
  token at N is in N+1 anyway; update N+1 drops its token (it is no longer running).
- advance N+1 runs after update N, not at launch: it hashes the blocks N+1 fills from
  token_ids, which holds token N only then. A sequence that stopped is not advanced.
- Blocks freed by update N (a stop, an abort) while N+1 still writes them may go to plan
  N+2 before wait N+1. That is safe because the device runs steps in launch order (one
  stream): N+2's writes land after N+1's. Blocks evicted from the prefix cache for N+1's
  tables go down to the host tier before the launch, as a schedule's do.
- Greedy outputs are the same tokens: every row computes what the serial step computes,
  from the same token, at the same position.
"""
from __future__ import annotations

from collections import deque

from kv.cache_manager import KVCacheManager
from worker.scheduling.plan import SchedulerOutput
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence, SequenceStatus


class AsyncScheduler(Scheduler):
    """The Scheduler of an engine whose runner overlaps the device: `schedule` takes the plan
    made ahead when it still holds, `plan_ahead` makes it under the device, `launch_ahead`
    hands it out before the step on the device is waited for."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._ahead: DecodeAhead | None = None  # the next plan, made under the device
        self.num_plans_ahead = 0  # plans taken from DecodeAhead (tests, profiling)

    def schedule(self) -> SchedulerOutput:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            out = ahead.take(self.running, self.waiting, self.loading)
            if out is not None:  # decodes only: no prompt chunk for the caps to time
                self._caps.start_step(self.running, self.waiting, None)
                self.num_plans_ahead += 1
                return out
        return super().schedule()

    def plan_ahead(self) -> None:
        """While an advanced plan's step is on the device: make the next plan now if it
        can only be decodes; the next `schedule` takes it if it still holds."""
        self._ahead = DecodeAhead.make(self.running, self.waiting, self.loading, self.kv,
                                       self.config.max_num_batched_tokens)

    def launch_ahead(self) -> SchedulerOutput | None:
        """The plan made ahead, to launch before the step on the device is waited for;
        None leaves it to the next `schedule`."""
        ahead = self._ahead
        if ahead is None:
            return None
        out = launch_plan(ahead.seqs, ahead.block_ids, self.config.max_model_len)
        if out is None:
            return None
        self._ahead = None
        self._caps.start_step(self.running, self.waiting, None)
        self.num_plans_ahead += 1
        return out


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


def last_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Will the token `seq` is about to get (one past its token_ids) end it by length?
    The length half of worker/scheduling/stop_check.py, one token early."""
    num_tokens = len(seq.token_ids) + 1
    return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= max_model_len


def launch_plan(seqs: list[Sequence], block_ids: list[list[int]], max_model_len: int) -> SchedulerOutput | None:
    """The plan to launch ahead from a decode-ahead plan's rows (each table already holds
    the pending token); None when no row would outlive its pending token, or when a row
    has a grammar or may be forced to end its thinking (its forced token depends on the
    pending one)."""
    out = SchedulerOutput(pending_inputs=True)
    for seq, table in zip(seqs, block_ids):
        if seq.grammar is not None or (seq.thinking is not None and seq.thinking.may_force_next()):
            return None
        if last_by_length(seq, max_model_len):
            continue
        out.seqs.append(seq)
        out.block_ids.append(table)
    if not out.seqs:
        return None
    out.num_new_tokens = [1] * len(out.seqs)
    return out
