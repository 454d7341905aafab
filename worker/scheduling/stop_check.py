"""When a sequence stops: its grammar terminates, an EOS or stop token (after min_tokens),
max_tokens, or the model's length."""
from __future__ import annotations

from worker.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, token_id: int, max_model_len: int) -> bool:
    """Does `seq` stop at `token_id`, just appended? If so it is FINISHED with its reason."""
    params = seq.params
    num_tokens = len(seq.token_ids)
    num_output = num_tokens - seq.num_prompt_tokens
    reason: str | None = None
    if seq.thinking is not None:
        seq.thinking.advance(seq.token_ids, seq.num_prompt_tokens)
    # A constrained output is complete when its grammar terminates (every token
    # advances the matcher, so this runs before the other checks).
    if seq.grammar is not None and seq.grammar.accept(token_id):
        reason = "stop"
    elif num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            reason = "stop"
        elif token_id in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token_id
    if reason is None and (num_output >= params.max_tokens or num_tokens >= max_model_len):
        reason = "length"
    if reason is None:
        return False
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = reason
    return True
