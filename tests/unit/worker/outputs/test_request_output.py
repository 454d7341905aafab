"""request_output builds a RequestOutput positionally (once per token, for speed): every
field must still come from the sequence attribute of the same meaning."""
from __future__ import annotations

from dataclasses import fields

from worker.api import RequestOutput, SamplingParams
from worker.outputs.request_output import request_output
from worker.sequence import Sequence, SequenceStatus


def test_every_field_by_name() -> None:
    seq = Sequence("req-7", [11, 12, 13, 14], SamplingParams(max_tokens=9), arrival_time=100.5)
    seq.token_ids += [21, 22]
    seq.num_cached_tokens = 3
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = "stop"
    seq.stop_reason = 22
    seq.first_token_time = 101.25
    seq.scheduled_time = 100.75
    seq.num_preemptions = 5
    logprobs = [object()]
    out = request_output(seq, [22], logprobs)
    expected = RequestOutput(
        request_id="req-7", new_token_ids=[22], text_delta="", finished=True, finish_reason="stop", stop_reason=22,
        logprobs=logprobs, prompt_logprobs=None, num_prompt_tokens=4, num_output_tokens=2, num_cached_tokens=3,
        error=None, arrival_time=100.5, first_token_time=101.25, scheduled_time=100.75, num_preemptions=5, extra={},
    )
    for f in fields(RequestOutput):
        assert getattr(out, f.name) == getattr(expected, f.name), f.name
    assert out.extra is not request_output(seq, [], None).extra  # a fresh dict per output


def test_running_sequence_is_not_finished() -> None:
    seq = Sequence("r", [1, 2], SamplingParams())
    seq.status = SequenceStatus.RUNNING
    out = request_output(seq, [], None)
    assert not out.finished and out.finish_reason is None and out.num_output_tokens == 0 and out.error is None
