"""Turns the engine core's token-level outputs into what a client sees: text deltas
and stop strings. Runs beside the caller (not on the step thread), as vLLM v1 does, so
detokenization never lengthens an engine step."""
from __future__ import annotations

from typing import Any

from worker.outputs.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from worker.api import RequestOutput
from worker.api import SamplingParams


class RequestOutputProcessor:
    """Per-request: incremental text, stop-string matching, final flush.

    `text_at_end`: the caller reads the text only when the request has finished (a
    non-streamed response). Then, unless a stop string must be watched for, the tokens
    after the first output are decoded once, with the finished one, instead of one window
    per step: the same text (the detokenizer's windows equal a full decode), a fraction of
    the decoding. The first output is decoded at once: it is the one a migration resumes
    from, so its text must be final when it leaves."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, num_resumed_tokens: int = 0,
        text_at_end: bool = False,
    ) -> None:
        # A migrated request: its last `num_resumed_tokens` prompt tokens were output on
        # another replica. Replaying them one per step, as they were produced, puts the
        # detokenizer in the exact state the dead replica's was in (held-back partial
        # characters and stop-string prefixes included); their text was already sent.
        num_resumed = max(0, min(num_resumed_tokens, len(prompt_token_ids) - 1))
        resumed = prompt_token_ids[len(prompt_token_ids) - num_resumed :] if num_resumed else []
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids[: len(prompt_token_ids) - num_resumed],
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if params.detokenize and tokenizer is not None
            else None
        )
        self.stopped = False  # a stop string ended the request here (the core must abort it)
        self._watches_stops = bool(params.stop)
        self._defer = text_at_end and not params.stop
        self._started = False  # an output with tokens was processed
        self._pending: list[int] = []  # deferred token ids, decoded with the finished output
        if self.detokenizer is not None:
            for token_id in resumed:
                self.detokenizer.update([token_id])

    def process(self, out: RequestOutput) -> RequestOutput:
        if self.detokenizer is None:
            return out
        ids = out.new_token_ids
        if self._defer and self._started and not out.finished:
            self._pending.extend(ids)
            return out  # text_delta stays "": this output's text leaves with the last one
        if self._pending:
            ids, self._pending = self._pending + ids, []
        self._started = self._started or bool(ids)
        if len(ids) > 1 and self._watches_stops:
            update = self._update_to_stop(out)
        else:
            update = self.detokenizer.update(ids) if ids else None
        delta = update.text_delta if update is not None else ""
        if update is not None and update.stop_string is not None:
            self.stopped = True
            out.finished, out.finish_reason, out.stop_reason = True, "stop", update.stop_string
        elif out.finished:
            delta += self.detokenizer.flush()
        out.text_delta = delta
        return out

    def _update_to_stop(self, out: RequestOutput) -> DetokenizerUpdate:
        """Several tokens at once (a verified run of drafts, folded outputs) with stop strings
        to watch: fed one by one, so that a stop string completed by one of them ends the
        output at that token, as it would have ended the request there; the tokens after it
        leave the output and its count."""
        assert self.detokenizer is not None
        ids = out.new_token_ids
        deltas: list[str] = []
        for j, token_id in enumerate(ids):  # stops: the detokenizer's own per-token rule
            update = self.detokenizer.update([token_id])
            deltas.append(update.text_delta)
            if update.stop_string is not None:
                dropped = len(ids) - j - 1
                if dropped:
                    out.new_token_ids = ids[: j + 1]
                    out.num_output_tokens -= dropped
                    if out.logprobs is not None:
                        out.logprobs = out.logprobs[: len(out.logprobs) - dropped]
                return DetokenizerUpdate("".join(deltas), update.stop_string)
        return DetokenizerUpdate("".join(deltas), None)

    @property
    def defers_text(self) -> bool:
        """Only the first output's text and the finished one's are read (no stop string
        to watch): the outputs between need not exist at all (Engine.add_request's quiet)."""
        return self._defer

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
