"""Admission through a lower KV tier: with KV tiers below the device (worker/kvcache/tiers.py), a
waiting sequence whose prefix continues past the device's cache in a lower tier is admitted
into the scheduler's `loading` list instead of `running`. Blocks for the whole found prefix
are allocated, the plan's `kv_loads` says which tier blocks go into which device blocks,
the engine copies them, and the scheduler's `finish_load` moves the sequence to `running`
with the loaded blocks computed and cached. It takes no token budget while it loads.
The scheduler (worker/scheduling/scheduler.py) owns the lists; these functions do the KV bookkeeping.
"""
from __future__ import annotations

import time

from kv.block_pool import Block
from kv.cache_manager import KVCacheManager
from worker.scheduling.plan import SchedulerOutput, TierIndex, TierLoad
from worker.sequence import Sequence, SequenceStatus


def num_tier_blocks(kv: KVCacheManager, tiers: TierIndex | None, seq: Sequence, num_hits: int) -> int:
    """Blocks right after the device hits that a lower tier holds (one token is always
    left to compute)."""
    if tiers is None:
        return 0
    max_blocks = (seq.num_tokens - 1) // kv.block_size
    hashes = kv.block_hashes(seq.request_id)[num_hits:max_blocks]
    return tiers.num_available(hashes) if hashes else 0


def start_load(out: SchedulerOutput, kv: KVCacheManager, seq: Sequence, hits: list[Block], num_tier: int) -> bool:
    """Give waiting `seq` blocks for its device hits and `num_tier` tier blocks after them,
    add the tier blocks' copy to the plan and mark it loading; False when they do not fit
    (it stays where it waits)."""
    num_hits, block_size = len(hits), kv.block_size
    num_tokens = (num_hits + num_tier) * block_size
    if not kv.can_allocate(seq.request_id, num_tokens, hits):
        return False
    block_ids = kv.allocate(seq.request_id, num_tokens, hits)
    hashes = kv.block_hashes(seq.request_id)
    out.kv_loads.append(TierLoad(seq, hashes[num_hits : num_hits + num_tier],
                                 block_ids[num_hits : num_hits + num_tier]))
    seq.num_computed_tokens = num_hits * block_size
    seq.status = SequenceStatus.LOADING
    if seq.scheduled_time is None:
        seq.scheduled_time = time.monotonic()
    return True


def apply_load(kv: KVCacheManager, seq: Sequence, num_loaded_blocks: int) -> None:
    """A loading sequence's first `num_loaded_blocks` tier blocks hold their KV now: count
    them computed, register them in the prefix cache and mark it running."""
    num_computed = seq.num_computed_tokens + num_loaded_blocks * kv.block_size
    kv.cache_computed(seq.request_id, seq.token_ids, num_computed, seq.hash_root)
    if seq.num_preemptions == 0:
        kv.record_admission(seq.num_prompt_tokens, num_computed)
        seq.num_cached_tokens = num_computed
    seq.num_computed_tokens = num_computed
    seq.status = SequenceStatus.RUNNING
