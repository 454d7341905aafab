"""Applying a step to its sequences, in two halves: `advance_plan` needs the plan alone
(the tokens a step computes are its inputs), `append_sampled` needs the tokens it sampled.
The overlapped loop runs the first while the step is on the device and the second after
it (worker/scheduling/async_scheduler.py); the serial loop runs both after the step. Both are once per
planned sequence per step, so their loops are kept flat.

    before advance:  token_ids [ ... c-1 | c ... c+n-1 | ... ]   num_computed_tokens = c
    after advance:   num_computed_tokens = c + n  (the step writes positions c .. c+n-1;
                     a block it fills is registered in the prefix cache)
    after append:    token_ids += [sampled]  when c + n reached the end of token_ids
"""
from __future__ import annotations

from collections.abc import Callable

from kv.cache_manager import KVCacheManager
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus
from worker.scheduling.stop_check import check_stop


def advance_plan(out: SchedulerOutput, kv: KVCacheManager) -> None:
    """Move the plan's running sequences past its tokens, once per plan."""
    if out.advanced:
        return
    out.advanced = True
    block_size = kv.block_size
    running = SequenceStatus.RUNNING
    drafts = out.draft_token_ids
    for seq, num_new in zip(out.seqs, out.num_new_tokens):
        if seq.status is not running:
            continue
        if drafts and seq.request_id in drafts:
            num_new = 1  # a verify row: its drafts count once accepted (worker/spec/apply.py)
        before = seq.num_computed_tokens
        seq.num_computed_tokens = after = before + num_new
        if after // block_size > before // block_size:  # a block filled: register it
            kv.cache_computed(seq.request_id, seq.token_ids, after, seq.hash_root)


def append_sampled(out: SchedulerOutput, sampled_token_ids: list[int | None], kv: KVCacheManager,
                   max_model_len: int, release_lora: Callable[[Sequence], None]) -> tuple[list[Sequence], bool]:
    """Append each running sequence's sampled token and run its stop checks; a sequence
    that stops is freed. Returns those that got a token, and whether any stopped."""
    changed: list[Sequence] = []
    any_finished = False
    running = SequenceStatus.RUNNING
    for seq, token_id in zip(out.seqs, sampled_token_ids):
        # None: a prompt chunk that did not reach the end of the prompt. Not running:
        # aborted (or failed) while the step was on the device; its token is dropped.
        if token_id is None or seq.status is not running:
            continue
        seq.token_ids.append(token_id)  # Sequence.append_token, inlined (once per token)
        changed.append(seq)
        if check_stop(seq, token_id, max_model_len):
            any_finished = True
            kv.free(seq.request_id, session_id=seq.session_id)
            if seq.lora_slot >= 0:
                release_lora(seq)
    return changed, any_finished
