"""A step's result as its callers see it: one RequestOutput per sequence that got a token,
and the outputs of requests that end with an error instead of a token.

A request that ends here leaves the engine's table of requests and unpins its adapter; one
that ends with an error is also finished in the KV connector and the scheduler, so that its
blocks (pinned exported ones too) are free when its output is made.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from worker.api import RequestOutput, TokenLogprob
from worker.kvcache.connector import SavedKV
from worker.outputs.request_output import request_output, sampled_output
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the engine imports this module
    from worker.engine.core import Engine


def sampled_outputs(
    engine: Engine, plan: SchedulerOutput, logprobs: list[TokenLogprob | None], changed: list[Sequence],
    saved: SavedKV,
) -> list[RequestOutput]:
    """One output per sequence that got a token; an export rides on its first one."""
    # Most steps sample no logprobs: skip the lookup table then (count runs in C).
    logprobs_of = (None if logprobs.count(None) == len(logprobs)
                   else {seq.request_id: lp for seq, lp in zip(plan.seqs, logprobs)})
    outputs = []
    now = time.monotonic()
    finished = SequenceStatus.FINISHED
    for seq in changed:
        if seq.first_token_time is None:
            seq.first_token_time = now
        kv = saved.get(seq.request_id) if saved else None
        if seq.quiet_from is not None and seq.quiet_from > seq.num_prompt_tokens and kv is None \
                and seq.status is not finished:
            continue  # a quiet request between its first output and its last
        if seq.status is finished:
            del engine.seqs[seq.request_id]
            if seq.lora_name is not None:
                engine.lora.done(seq)
        out = sampled_output(seq, logprobs_of.get(seq.request_id) if logprobs_of is not None else None)
        if seq.quiet_from is not None:
            out.new_token_ids = seq.token_ids[seq.quiet_from:]
            seq.quiet_from = len(seq.token_ids)
        if isinstance(kv, str):  # its KV export failed: an error, not a clean finish
            out = fail_request(engine, seq, kv)
        elif kv is not None:
            out.extra["kv_export"] = kv
        if seq.status is finished:  # after the export check: a failed export is no answer length
            engine.output_lengths.observe(seq)
        outputs.append(out)
    return outputs


def fail_step(engine: Engine, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
    """End every request of a step that failed (those it had not finished) with its error."""
    message = f"engine step failed: {type(error).__name__}: {error}"
    return [fail_request(engine, seq, message) for seq in plan.seqs if seq.status is not SequenceStatus.FINISHED]


def fail_request(engine: Engine, seq: Sequence, message: str) -> RequestOutput:
    """End one request with an error; its blocks are free when this returns."""
    engine.connector.request_finished(seq.request_id)
    if seq.status is not SequenceStatus.FINISHED:
        engine.scheduler.finish(seq, "error")
    # A request can fail after it finished normally this step (a failed KV export of a
    # max_tokens=1 prefill): the error must win, or the caller sees a clean "length".
    seq.finish_reason = "error"
    engine.seqs.pop(seq.request_id, None)
    if seq.lora_name is not None and engine.lora is not None:
        engine.lora.done(seq)
    out = request_output(seq, [], None)
    out.error = message
    return out
