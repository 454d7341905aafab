"""The engine's requests, from `add_request` to their last output, and every change to one
outside a step's plan (the plan's own changes are the scheduler's `advance`/`update`):

    add ──> [adapter load] ──> [grammar compile] ──> scheduler ──> step outputs ──> gone
             worker/lora/       worker/structured/    waiting,       one per sequence
             engine_lora.py     compile_waits.py      running,       that got a token;
                                                      loading        a finished one leaves
    any point: fail (an error output; blocks, pins and the adapter let go) or abort

A failed wait fails its request. The waits that end outside the scheduler (compiles,
adapter loads) are admitted as each step's plan starts; tier reads and KV imports are for
sequences the scheduler admitted already. All of it runs on the engine thread.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from worker.api import RequestOutput, TokenLogprob
from worker.engine.step_meters import OutputLengthTracker
from worker.kvcache.connector import KVConnector, SavedKV
from worker.outputs.request_output import request_output, sampled_output
from worker.scheduling.plan import SchedulerOutput
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence, SequenceStatus
from worker.structured.compile_waits import CompileWaits

if TYPE_CHECKING:
    from worker.kvcache.tiers import TierManager
    from worker.lora.engine_lora import EngineLoRA

# How long an otherwise idle step waits for a grammar compile, an adapter load or a tier
# read (new requests wait at most this long in the inbox meanwhile).
GRAMMAR_POLL_S = 0.005


class Requests:
    """The table of an engine's requests (`seqs`, by request id) and what happens to them
    between the scheduler's steps."""

    def __init__(self, scheduler: Scheduler, connector: KVConnector, output_lengths: OutputLengthTracker) -> None:
        self.scheduler = scheduler
        self.connector = connector
        self.output_lengths = output_lengths
        self.seqs: dict[str, Sequence] = {}
        self.compiles = CompileWaits()  # the compiler is set when the engine has a tokenizer
        self.lora: EngineLoRA | None = None  # the engine's, when LoRA is enabled
        self.tiers: TierManager | None = None  # the engine's, with KV tiers below the device

    # -- entering the scheduler --------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """A request with all it needs but its grammar goes to the scheduler, or waits for
        the grammar's compile (at most the compiler's timeout)."""
        if not self.compiles.submit(seq):
            self.scheduler.add(seq)

    def admit_ready(self) -> list[RequestOutput]:
        """As a plan starts: requests whose grammar compiled or whose adapter reached host
        memory go on, sequences whose tier reads are done may run; a failed wait fails
        its request."""
        outputs = self._admit_compiled() if self.compiles.seqs else []
        if self.lora is not None and self.lora.num_loading:
            outputs += self._admit_lora_loaded()
        tiers = self.tiers
        if tiers is not None and tiers.has_pending:
            self.finish_tier_loads(tiers.poll())
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        ready, failed = self.compiles.take_compiled()
        for seq in ready:  # in arrival order
            self.scheduler.add(seq)
        outputs = []
        for seq, error in failed:
            seq.status = SequenceStatus.FINISHED
            outputs.append(self.fail(seq, error))
        return outputs

    def _admit_lora_loaded(self) -> list[RequestOutput]:
        assert self.lora is not None
        ready, failed = self.lora.take_loaded()
        for seq in ready:
            self.admit(seq)
        outputs = []
        for seq, message in failed:
            seq.status = SequenceStatus.FINISHED
            outputs.append(self.fail(seq, f"LoRA adapter {seq.lora_name!r}: {message}"))
        return outputs

    def finish_tier_loads(self, done: list[tuple[Sequence, int]]) -> None:
        """Sequences whose blocks a tier has read back may run now."""
        for seq, num_blocks in done:
            self.scheduler.finish_load(seq, num_blocks)

    def load_kv(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Let the connector write the KV imported for this plan; a failed import leaves the
        plan and fails its request."""
        if not plan.kv_imports:
            return []
        outputs = []
        for seq, message in self.connector.load_kv(plan):
            plan.remove(seq)
            outputs.append(self.fail(seq, message))
        return outputs

    @property
    def num_waiting_outside(self) -> int:
        """Requests not in the scheduler yet: compiling their grammar or loading their adapter."""
        return len(self.compiles.seqs) + (self.lora.num_loading if self.lora is not None else 0)

    def wait_for_any(self) -> None:
        """Nothing to run but grammar compiles, adapter loads or tier reads: wait for one, briefly."""
        futures = self.compiles.futures()
        if self.lora is not None:
            futures += self.lora.futures()
        if self.tiers is not None:
            futures += self.tiers.pending_futures()
        if futures:
            wait(futures, GRAMMAR_POLL_S, FIRST_COMPLETED)

    # -- leaving -----------------------------------------------------------------------------
    def step_outputs(self, plan: SchedulerOutput, logprobs: list[TokenLogprob | None], changed: list[Sequence],
                     saved: SavedKV) -> list[RequestOutput]:
        """One output per sequence that got a token (a quiet one: its first and its last);
        a finished sequence leaves the table; an export rides on its first output."""
        # Most steps sample no logprobs: skip the lookup table then (count runs in C).
        logprobs_of = (None if logprobs.count(None) == len(logprobs)
                       else {seq.request_id: lp for seq, lp in zip(plan.seqs, logprobs)})
        outputs = []
        now = time.monotonic()
        finished = SequenceStatus.FINISHED
        appended = plan.num_appended  # verify rows' token counts (speculative decoding)
        for seq in changed:
            if seq.first_token_time is None:
                seq.first_token_time = now
            kv = saved.get(seq.request_id) if saved else None
            if seq.quiet_from is not None and seq.quiet_from > seq.num_prompt_tokens and kv is None \
                    and seq.status is not finished:
                continue  # a quiet request between its first output and its last
            if seq.status is finished:
                self._forget(seq)
            out = sampled_output(seq, logprobs_of.get(seq.request_id) if logprobs_of is not None else None,
                                 appended.get(seq.request_id, 1) if appended else 1)
            if seq.quiet_from is not None:
                out.new_token_ids = seq.token_ids[seq.quiet_from:]
                seq.quiet_from = len(seq.token_ids)
            if isinstance(kv, str):  # its KV export failed: an error, not a clean finish
                out = self.fail(seq, kv)
            elif kv is not None:
                out.extra["kv_export"] = kv
            if seq.status is finished:  # after the export check: a failed export is no answer length
                self.output_lengths.observe(seq)
                if seq.num_draft_tokens:  # speculative decoding: the request's own acceptance
                    out.extra["spec_draft_tokens"] = seq.num_draft_tokens
                    out.extra["spec_accepted_tokens"] = seq.num_accepted_draft_tokens
            outputs.append(out)
        return outputs

    def fail_step(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """End every request of a step that failed (those it had not finished) with its error."""
        message = f"engine step failed: {type(error).__name__}: {error}"
        return [self.fail(seq, message) for seq in plan.seqs if seq.status is not SequenceStatus.FINISHED]

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error; its blocks (pinned exported ones too) are free
        when this returns."""
        self.connector.request_finished(seq.request_id)
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        # A request can fail after it finished normally this step (a failed KV export of a
        # max_tokens=1 prefill): the error must win, or the caller sees a clean "length".
        seq.finish_reason = "error"
        self._forget(seq)
        out = request_output(seq, [], None)
        out.error = message
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is; its blocks (pinned exported ones too) are free
        when this returns. Its output carries a quiet request's tokens since its last one."""
        self.connector.request_finished(request_id)
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        if self.compiles.remove(seq):  # not in the scheduler yet
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if self.lora is not None and seq.lora_name is not None and self.lora.is_loading(seq):
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"  # not in the scheduler yet
        self._forget(seq)
        self.scheduler.finish(seq, "abort")
        return request_output(seq, seq.token_ids[seq.quiet_from:] if seq.quiet_from is not None else [], None)

    def _forget(self, seq: Sequence) -> None:
        """The request leaves the table and unpins its adapter (EngineLoRA.done: once, however
        many end paths it takes)."""
        self.seqs.pop(seq.request_id, None)
        if seq.lora_name is not None and self.lora is not None:
            self.lora.done(seq)
