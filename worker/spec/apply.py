"""A step's result applied to a plan whose decode rows carried drafts: the scheduler's
`update` for such plans (worker/scheduling/step_apply.py's append_sampled serves the rest).

A verify row of sequence s, planned at num_computed_tokens = c with drafts d1..dk, comes
back with tokens t1..t(a+1): the a accepted drafts (t_j = d_j) and one token of the
target's own (the bonus, or the replacement of the first rejected draft):

    before:   token_ids [ ... | x ]                       num_computed = c + 1 (advance_plan)
    after:    token_ids [ ... | x d1 .. da t(a+1) ]        num_computed = c + 1 + a

The KV at positions c+1 .. c+a was written from d1 .. da, which are now s's tokens: it
is valid, so num_computed_tokens moves past it (and blocks it fills are registered). The
KV at c+a+1 .. c+k came from rejected drafts: it is left to be overwritten, and blocks
that only it used go back to the pool. Each appended token gets the stop checks of a
sampled one, in order: an EOS, a stop token, max_tokens or the model's length inside the
run ends it there, and the tokens after it are dropped.
"""
from __future__ import annotations

from collections.abc import Callable

from kv.cache_manager import KVCacheManager
from worker.scheduling.plan import SchedulerOutput
from worker.scheduling.stop_check import check_stop
from worker.sequence import Sequence, SequenceStatus
from worker.spec.stats import SpecCounters


def append_verified(out: SchedulerOutput, sampled_token_ids: list[int | None],
                    verified_token_ids: dict[int, list[int]], kv: KVCacheManager, max_model_len: int,
                    release_lora: Callable[[Sequence], None],
                    counters: SpecCounters) -> tuple[list[Sequence], bool]:
    """append_sampled for a plan with verify rows: returns the sequences that got tokens,
    and whether any stopped. `verified_token_ids[i]`: plan row i's tokens, when it verified."""
    changed: list[Sequence] = []
    any_finished = False
    running = SequenceStatus.RUNNING
    drafts_of, appended = out.draft_token_ids, out.num_appended
    for i, (seq, token_id) in enumerate(zip(out.seqs, sampled_token_ids)):
        if token_id is None or seq.status is not running:
            continue
        drafts = drafts_of.get(seq.request_id)
        tokens = verified_token_ids[i] if drafts is not None else [token_id]
        if drafts is not None:
            counters.verified(len(drafts), len(tokens) - 1)
            seq.num_draft_tokens += len(drafts)
            seq.num_accepted_draft_tokens += len(tokens) - 1
        stopped = False
        num = 0
        for token in tokens:  # at most k + 1: each token is checked as a sampled one is
            seq.token_ids.append(token)
            num += 1
            if check_stop(seq, token, max_model_len):
                stopped = True
                break
        changed.append(seq)
        if drafts is not None:
            appended[seq.request_id] = num
        if stopped:
            any_finished = True
            kv.free(seq.request_id, session_id=seq.session_id)
            if seq.lora_slot >= 0:
                release_lora(seq)
        elif drafts is not None:
            _advance_accepted(seq, len(tokens) - 1, kv)
    return changed, any_finished


def _advance_accepted(seq: Sequence, num_accepted: int, kv: KVCacheManager) -> None:
    """Move past the accepted drafts' KV, register the blocks it fills, and give back the
    blocks only rejected drafts wrote."""
    before = seq.num_computed_tokens
    seq.num_computed_tokens = after = before + num_accepted
    if after // kv.block_size > before // kv.block_size:
        kv.cache_computed(seq.request_id, seq.token_ids, after, seq.hash_root)
    kv.shrink(seq.request_id, len(seq.token_ids))


def num_step_tokens(plan: SchedulerOutput, changed: list[Sequence]) -> int:
    """Tokens a step appended: one per sequence that got any, and a verify row's whole run."""
    appended = plan.num_appended
    if not appended:
        return len(changed)
    return len(changed) + sum(appended.values()) - len(appended)


def prefill_rows(plan: SchedulerOutput) -> list[int]:
    """The plan's new tokens per row as the prefill-rate meter reads them: a verify row is a
    decode (one token), not prefill, whatever its drafts."""
    drafts = plan.draft_token_ids
    if not drafts:
        return plan.num_new_tokens
    return [1 if seq.request_id in drafts else n for seq, n in zip(plan.seqs, plan.num_new_tokens)]
