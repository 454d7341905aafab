"""One RequestOutput from a sequence's state: built once per token, so built positionally."""
from __future__ import annotations

from worker.api import RequestOutput
from worker.sequence import Sequence, SequenceStatus


def request_output(seq: Sequence, new_token_ids: list[int], logprobs: list | None) -> RequestOutput:
    """The RequestOutput of `seq` as it stands, carrying `new_token_ids` (and their logprobs)."""
    # Positional, in RequestOutput's field order: this runs once per token, and keywords
    # cost measurably more than positions there (tests/unit/worker/test_engine_output.py
    # checks every field by name).
    return RequestOutput(
        seq.request_id,
        new_token_ids,
        "",  # text_delta: the detokenizer's, downstream
        seq.status is SequenceStatus.FINISHED,
        seq.finish_reason,
        seq.stop_reason,
        logprobs,
        None,  # prompt_logprobs: set by the caller on a first output that carries them
        seq.num_prompt_tokens,
        len(seq.token_ids) - seq.num_prompt_tokens,
        seq.num_cached_tokens,
        None,  # error
        seq.arrival_time,
        seq.first_token_time,
        seq.scheduled_time,
        seq.num_preemptions,
    )


def sampled_output(seq: Sequence, logprob: object | None, num_tokens: int = 1) -> RequestOutput:
    """The output of a step that gave `seq` its last `num_tokens` tokens (one, or a verified
    run of drafts: worker/spec/) and its logprob entry, if asked. A request's first output
    also carries its prompt logprobs, when they are complete: a decode-side import computed
    no prompt, and its prefill replica's first output carried them."""
    new = [seq.token_ids[-1]] if num_tokens == 1 else seq.token_ids[-num_tokens:]
    out = request_output(seq, new, [logprob] if logprob is not None else None)
    entries = seq.prompt_logprobs
    if entries is not None and seq.num_output_tokens == 1 and len(entries) == seq.num_prompt_tokens - 1:
        out.prompt_logprobs = [None, *entries]
    return out
