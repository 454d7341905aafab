"""Turns the engine core's token-level outputs into what a client sees: text deltas
and stop strings. Runs beside the caller (not on the step thread), as vLLM v1 does, so
detokenization never lengthens an engine step."""
from __future__ import annotations

from typing import Any

from worker.detokenizer import IncrementalDetokenizer
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams


class RequestOutputProcessor:
    """Per-request: incremental text, stop-string matching, final flush."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if params.detokenize and tokenizer is not None
            else None
        )
        self.stopped = False  # a stop string ended the request here (the core must abort it)

    def process(self, out: RequestOutput) -> RequestOutput:
        if self.detokenizer is None:
            return out
        update = self.detokenizer.update(out.new_token_ids) if out.new_token_ids else None
        delta = update.text_delta if update is not None else ""
        if update is not None and update.stop_string is not None:
            self.stopped = True
            out.finished, out.finish_reason, out.stop_reason = True, "stop", update.stop_string
        elif out.finished:
            delta += self.detokenizer.flush()
        out.text_delta = delta
        return out

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
