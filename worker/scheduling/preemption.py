"""Preemption: which running sequence gives up its place to another, and when. The
scheduler (worker/scheduling/scheduler.py) calls these while it builds a plan, passing its own
`_preempt` as `preempt`: that requeues a sequence these took out of `running`.

Two causes, the victim chosen by worker/scheduling/bands.py in both:
- for want of memory (`make_room`): a running sequence that cannot get its next block
  preempts the worst band's most recently admitted running sequence, until its blocks fit
  or it was that sequence itself. A step short of memory for its running sequences
  admits no waiting one (`may_admit`).
- for priority (`preempt_for_priority`): the next waiting sequence that could not be
  admitted (no running slot, or its blocks do not fit) takes the place of a running one of
  a worse band, or of its band's key furthest over its share when its own key is under.
  Admission goes on in that step: the place was freed for it.
Recompute, not swap (`reset_for_recompute`): a preempted sequence's blocks are freed, it
rejoins the front of its band, and its KV is rebuilt from its token ids when it is admitted
again (prefix cache permitting), so it resumes exactly where it was.
Torch-free, as the scheduler is.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kv.cache_manager import KVCacheManager
from worker.scheduling import bands
from worker.scheduling.bands import KeyShares
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus


def may_admit(out: SchedulerOutput) -> bool:
    """No admission in a step that preempted for want of memory."""
    return len(out.preempted) == out.preempted_for_priority


def fits(kv: KVCacheManager, seq: Sequence) -> bool:
    """Could `seq`'s whole uncomputed prompt get its blocks now (cache hits counted)?"""
    hits = [] if seq.kv_import is not None else kv.get_computed_blocks(seq.request_id, seq.token_ids, seq.hash_root)
    return kv.can_allocate(seq.request_id, seq.num_tokens, hits)


def preempt_for_priority(out: SchedulerOutput, waiting: deque[Sequence], running: list[Sequence],
                         shares: KeyShares | None, max_num_seqs: int, kv: KVCacheManager,
                         preempt: Callable[[Sequence], None]) -> None:
    """The next waiting sequence takes a running one's place when it could not be
    admitted otherwise (no running slot, or its blocks do not fit) and it is of a better
    band (the worst band's most recently admitted goes), or of a key under its share of
    its band whose slots another key holds over its own (worker/scheduling/bands.py). `preempt`
    requeues the victim into `waiting`."""
    while waiting and running:
        head = waiting[shares.pick(waiting) if shares is not None else 0]
        victim = bands.victim_for_waiting(head, running, shares)
        if victim is None or (len(running) < max_num_seqs and fits(kv, head)):
            return
        running.remove(victim)
        if shares is not None:
            shares.preempted(victim)
        preempt(victim)
        out.preempted.append(victim)
        # For a better band or a fair share, not for want of memory: admission goes on.
        out.preempted_for_priority += 1


def make_room(out: SchedulerOutput, kv: KVCacheManager, running: list[Sequence], seq: Sequence,
              num_tokens: int, preempt: Callable[[Sequence], None]) -> bool:
    """Preempt the most recently admitted running sequences until `seq` can hold
    `num_tokens`; False when `seq` itself had to go."""
    while not kv.can_allocate(seq.request_id, num_tokens):
        victim = bands.victim(running)  # the worst band's most recently admitted
        running.remove(victim)
        if victim in out.seqs:  # planned earlier this step: out of the plan
            out.remove(victim)
        preempt(victim)
        out.preempted.append(victim)
        if victim is seq:
            return False
    return True


def reset_for_recompute(kv: KVCacheManager, seq: Sequence, release_lora: Callable[[Sequence], None]) -> None:
    """Free a preempted sequence's blocks and LoRA slot and mark it waiting with nothing
    computed. Recompute, not swap: its KV is rebuilt from its token ids, prefix cache
    permitting (its tokens do not change, so its block hashes are kept for that lookup)."""
    kv.free(seq.request_id, keep_hashes=True)
    release_lora(seq)
    seq.status = SequenceStatus.WAITING
    seq.num_computed_tokens = 0
    seq.num_preemptions += 1
