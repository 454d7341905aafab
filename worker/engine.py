"""The engine core: schedule -> execute -> update, one iteration per `step()`.

Synchronous and single-threaded on purpose (the async wrapper runs it on its own thread):
the scheduler, block pool and sequences are only ever touched from one thread.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from kv.block_hash import hash_full_blocks
from kv.block_pool import Block
from kv.cache_manager import KVCacheManager, cdiv
from kv.stats import KVStats
from kv.transfer import DEFAULT_PIN_TIMEOUT_S, KVExport, KVTransferError, dtype_name
from worker.config import CacheConfig, EngineConfig, SchedulerConfig
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams
from worker.scheduler import Scheduler, SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A user-caused problem with a request (maps to HTTP 400 / gRPC INVALID_ARGUMENT)."""


class KVImportError(RequestError):
    """A KV export that this engine cannot import (layout mismatch, tokens that differ)."""


class Runner(Protocol):
    """What the engine needs from a model runner (the real one, or a fake in tests)."""

    num_blocks: int

    def execute(self, plan: SchedulerOutput) -> object: ...  # -> RunnerOutput

    # For disaggregation, a runner also offers (ModelRunner and TPModelRunner do):
    #   kv_spec: KVCacheSpec                  the layout of an export (all KV heads)
    #   export_kv(block_ids) -> Tensor        (layers, 2, len(block_ids) * bs, Hkv, D)
    #   import_kv(block_ids, kv) -> None      the inverse, into this runner's own blocks


@dataclass(frozen=True)
class EngineStats:
    kv: KVStats
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    num_preemptions: int
    num_generated_tokens: int
    num_steps: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    forward_share: float  # share of step time spent in the model forward (cumulative)
    scheduler_share: float = 0.0  # share of step time in schedule + update (cumulative)

    def to_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items() if k != "kv"}
        d.update(self.kv.to_dict())
        return d


class Engine:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        runner: Runner,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.kv = KVCacheManager(runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.seqs: dict[str, Sequence] = {}
        self.model_path: Path | None = None  # set when built from a model directory
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_time_s = 0.0
        self.forward_time_s = 0.0
        self.schedule_time_s = 0.0  # in Scheduler.schedule + Scheduler.update (CPU work)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s
        # Disaggregation (kv/transfer.py). Prefill side: requests whose KV is exported when
        # their first token is sampled; the exported blocks stay pinned (an extra reference)
        # until release_kv or their deadline. Decode side: imported
        # requests waiting for blocks, admitted first thing in a step, FIFO.
        self.pin_timeout_s = DEFAULT_PIN_TIMEOUT_S
        self._export_ids: set[str] = set()
        self._pinned: dict[str, tuple[list[Block], float]] = {}
        self._next_deadline = float("inf")  # earliest pin deadline (inf: none)
        self._pending_imports: deque[tuple[Sequence, KVExport]] = deque()
        # Tests only (fault tests): the n-th executed step raises once, as a runner bug would.
        self._fail_step = int(os.environ.get("KVSERVE_FAULT_INJECT_STEP_FAILURE", "0") or 0)
        self._num_executed = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        from worker.model.loader import resolve_model_path
        from worker.model_config import load_hf_config, eos_token_ids_of
        from worker.model_runner import ModelRunner

        from worker.sim.device import is_sim_device

        if is_sim_device(config.model.device):  # a simulated device: no weights (worker/sim/)
            from worker.sim.runner import sim_engine_from_config

            return sim_engine_from_config(config)
        path = resolve_model_path(config.model.model)
        hf_config = load_hf_config(path)
        max_model_len = min(config.scheduler.max_model_len, hf_config.max_position_embeddings)
        scheduler_config = replace(config.scheduler, max_model_len=max_model_len)
        config = replace(config, model=replace(config.model, model=str(path)), scheduler=scheduler_config)
        if config.model.tensor_parallel_size > 1:
            from worker.tp.runner import TPModelRunner

            runner = TPModelRunner(config, hf_config, max_model_len, config.model.tensor_parallel_size)
        else:
            runner = ModelRunner(config, hf_config, max_model_len)
        engine = cls(scheduler_config, config.cache, runner, hf_config.vocab_size, eos_token_ids_of(path, hf_config))
        engine.model_path = path
        return engine

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    # -- requests ------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that could never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; max_model_len is {self.max_model_len} "
                f"(at least one output token must fit)"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {self.vocab_size})")
        need = cdiv(min(n + params.max_tokens, self.max_model_len), self.kv.block_size)
        if need > self.kv.num_total_blocks:
            raise RequestError(
                f"the request needs {need} KV blocks but the pool has {self.kv.num_total_blocks}; "
                f"shorten the prompt or max_tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        export_kv: bool = False,
        kv_import: KVExport | None = None,
    ) -> None:
        """`export_kv`: when the first token is sampled, attach a KVExport of the prompt to
        that output (`extra["kv_export"]`) and pin its blocks until `release_kv`.
        `kv_import`: the prompt's KV computed elsewhere; the request continues after the
        export's first token (prompt + that token, the prompt already computed)."""
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if kv_import is not None:
            self._check_import(prompt_token_ids, params, kv_import)
        if export_kv and getattr(self.runner, "kv_spec", None) is None:
            raise KVImportError("this engine's runner cannot export its KV cache")
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        self.seqs[request_id] = seq
        if export_kv:
            self._export_ids.add(request_id)
        if kv_import is not None:
            assert kv_import.next_token_id is not None
            seq.append_token(kv_import.next_token_id)
            seq.num_cached_tokens = kv_import.num_cached_tokens
            self._pending_imports.append((seq, kv_import))
        else:
            self.scheduler.add(seq)

    # -- disaggregation: KV export (prefill side) and import (decode side) -----------------
    def _check_import(self, prompt_token_ids: list[int], params: SamplingParams, export: KVExport) -> None:
        spec = getattr(self.runner, "kv_spec", None)
        if spec is None:
            raise KVImportError("this engine's runner has no KV cache to import into")
        try:
            export.check_compatible(spec)
        except KVTransferError as e:
            raise KVImportError(str(e)) from None
        if list(prompt_token_ids) != list(export.token_ids):
            raise KVImportError(f"the KV export of {export.request_id!r} holds other tokens than the prompt")
        if export.next_token_id is None or not 0 <= export.next_token_id < self.vocab_size:
            raise KVImportError(f"the KV export of {export.request_id!r} has no valid first token")
        if params.max_tokens < 2:
            raise KVImportError("an imported request must still have tokens to generate (max_tokens >= 2)")

    def _admit_imports(self) -> list[RequestOutput]:
        """Give imported requests their own blocks, write their KV there, register the full
        blocks in the prefix cache and put them straight into `running`. Returns the
        outputs of imports that failed (their blocks are free again)."""
        failed: list[RequestOutput] = []
        while self._pending_imports and self.scheduler.num_running < self.scheduler_config.max_num_seqs:
            seq, export = self._pending_imports[0]
            if not self.kv.can_allocate(seq.request_id, export.num_tokens):
                break  # wait for blocks to free up (FIFO: a big import is not starved)
            self._pending_imports.popleft()
            block_ids = self.kv.allocate(seq.request_id, export.num_tokens)
            try:
                self.runner.import_kv(block_ids, export.kv)  # type: ignore[attr-defined]
            except Exception as e:  # e.g. a dead tensor-parallel rank
                logger.exception("KV import of %s failed", seq.request_id)
                self.kv.free(seq.request_id)  # not in waiting or running yet: end it here
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
                failed.append(self._fail_one(seq, f"KV import failed: {type(e).__name__}: {e}"))
                continue
            seq.num_computed_tokens = export.num_tokens
            self.kv.cache_computed(seq.request_id, seq.token_ids, export.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(seq)
        return failed

    def _export(self, seq: Sequence, blocks: list[Block]) -> KVExport:
        n = seq.num_computed_tokens  # the prompt; the token just sampled is not computed
        spec = self.runner.kv_spec  # type: ignore[attr-defined]  # all heads, under TP too
        block_ids = [b.block_id for b in blocks[: cdiv(n, self.kv.block_size)]]
        return KVExport(
            request_id=seq.request_id,
            kv=self.runner.export_kv(block_ids),  # type: ignore[attr-defined]
            token_ids=seq.token_ids[:n],
            next_token_id=seq.token_ids[n] if n < seq.num_tokens else None,
            block_size=self.kv.block_size,
            dtype=dtype_name(spec.dtype),
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_hashes=hash_full_blocks(seq.token_ids[:n], self.kv.block_size),
            num_cached_tokens=seq.num_cached_tokens,
        )

    def release_kv(self, request_id: str) -> bool:
        """The decode side has the request's KV (or gave up): unpin its blocks."""
        pinned = self._pinned.pop(request_id, None)
        if pinned is None:
            return False
        self.kv.unpin(pinned[0])
        return True

    def expire_pins(self, now: float | None = None) -> int:
        """Unpin exports nobody acknowledged within pin_timeout_s. Returns how many."""
        now = time.monotonic() if now is None else now
        # A scan, but over the transfers in flight only (few), and only once one is due.
        if self._next_deadline > now:
            return 0
        expired = [request_id for request_id, (_, deadline) in self._pinned.items() if deadline <= now]
        for request_id in expired:
            logger.warning("KV export of %s was not acknowledged within %.0f s; freeing it", request_id, self.pin_timeout_s)
            self.release_kv(request_id)
        self._next_deadline = min((d for _, d in self._pinned.values()), default=float("inf"))
        return len(expired)

    def next_pin_deadline(self) -> float | None:
        return self._next_deadline if self._pinned else None

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks, _ in self._pinned.values())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks (pinned exported ones too) are free when this returns."""
        self.release_kv(request_id)
        self._export_ids.discard(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        pending = next((item for item in self._pending_imports if item[0] is seq), None)
        if pending is not None:  # never admitted: it holds no blocks
            self._pending_imports.remove(pending)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        else:
            self.scheduler.finish(seq, "abort")
        return self._output(seq, [], None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_imports)

    # -- the iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self._pinned:
            self.expire_pins()
        failed = self._admit_imports() if self._pending_imports else []
        t = time.perf_counter()
        plan = self.scheduler.schedule()
        self.schedule_time_s += time.perf_counter() - t
        if plan.is_empty:
            return failed
        try:
            self._num_executed += 1
            if self._num_executed == self._fail_step:
                raise RuntimeError(f"injected fault (KVSERVE_FAULT_INJECT_STEP_FAILURE={self._fail_step})")
            result = self.runner.execute(plan)
        except Exception as e:  # fail this step's requests, keep serving the rest
            logger.exception("engine step failed; failing %d requests", len(plan.seqs))
            return failed + self._fail(plan, e)
        # Exported requests sample their first token now; update() frees finished ones,
        # so their blocks are pinned first (the KV is copied out below, after update).
        exporting = (
            [(seq, self.kv.pin(seq.request_id)) for i, seq in enumerate(plan.seqs)
             if seq.request_id in self._export_ids and plan.samples(i)]
            if self._export_ids else []
        )
        t = time.perf_counter()
        changed = self.scheduler.update(plan, result.token_ids)
        self.schedule_time_s += time.perf_counter() - t
        exports: dict[str, KVExport] = {}
        export_errors: dict[str, str] = {}
        for seq, blocks in exporting:
            self._export_ids.discard(seq.request_id)
            if seq.num_computed_tokens < seq.num_tokens:  # it did get its token
                try:
                    exports[seq.request_id] = self._export(seq, blocks)
                except Exception as e:  # e.g. a dead tensor-parallel rank
                    logger.exception("KV export of %s failed", seq.request_id)
                    self.kv.unpin(blocks)
                    export_errors[seq.request_id] = f"KV export failed: {type(e).__name__}: {e}"
                    continue
                deadline = time.monotonic() + self.pin_timeout_s
                self._pinned[seq.request_id] = (blocks, deadline)
                self._next_deadline = min(self._next_deadline, deadline)
            else:
                self.kv.unpin(blocks)
        logprobs_of = {seq.request_id: lp for seq, lp in zip(plan.seqs, result.logprobs)}
        outputs = failed
        now = time.monotonic()
        for seq in changed:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.is_finished:
                del self.seqs[seq.request_id]
            lp = logprobs_of.get(seq.request_id)
            outputs.append(self._output(seq, [seq.token_ids[-1]], [lp] if lp is not None else None))
            if seq.request_id in exports:
                outputs[-1].extra["kv_export"] = exports[seq.request_id]
            elif seq.request_id in export_errors:
                outputs[-1] = self._fail_one(seq, export_errors[seq.request_id])
        self._account(len(changed), time.perf_counter() - start, result.forward_s)
        return outputs

    def _fail(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        message = f"engine step failed: {type(error).__name__}: {error}"
        return [self._fail_one(seq, message) for seq in plan.seqs if seq.status is not SequenceStatus.FINISHED]

    def _fail_one(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error; its blocks are free when this returns."""
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        # A request can fail after it finished normally this step (a failed KV export of a
        # max_tokens=1 prefill): the error must win, or the caller sees a clean "length".
        seq.finish_reason = "error"
        self.seqs.pop(seq.request_id, None)
        out = self._output(seq, [], None)
        out.error = message
        return out

    def _account(self, num_tokens: int, step_s: float, forward_s: float) -> None:
        self.num_steps += 1
        self.num_generated_tokens += num_tokens
        self.step_time_s += step_s
        self.forward_time_s += forward_s
        now = time.monotonic()
        self._recent.append((now, num_tokens))
        while self._recent and now - self._recent[0][0] > 5.0:
            self._recent.popleft()

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int], logprobs: list | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
        )

    def stats(self) -> EngineStats:
        recent = self._recent
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        tokens_per_s = sum(n for _, n in list(recent)[1:]) / span if span > 0 else 0.0
        return EngineStats(
            kv=self.kv.stats(),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_waiting_prompt_tokens=sum(s.num_uncomputed_tokens for s in self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            tokens_per_s=tokens_per_s,
            forward_share=self.forward_time_s / self.step_time_s if self.step_time_s else 0.0,
            scheduler_share=self.schedule_time_s / self.step_time_s if self.step_time_s else 0.0,
        )
