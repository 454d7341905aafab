"""The engine core: schedule -> execute -> postprocess, one iteration per `step()`.

Synchronous and single-threaded on purpose (the async wrapper runs it on its own thread):
the scheduler, block pool and sequences are only ever touched from one thread. On a runner
whose device works while the host does (worker/engine/overlap.py), the same iteration runs
in three calls instead, so that the previous step's outputs are built under the device's
time: launch_step (plan, launch, advance past the plan), step_outputs (of the step
before), complete_step (wait, update); its scheduler is then an AsyncScheduler, which plans
and launches decode steps ahead (worker/scheduling/async_scheduler.py draws the timeline).
Disaggregation (KV export and import) is not in the step: the KV connector
(worker/kvcache/connector.py) is called at fixed points of it. The engine's requests, and
every change to one outside a plan (waits, failures, outputs, aborts), are
worker/scheduling/requests.py's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kv.block_hash import root_hash
from kv.cache_manager import KVCacheManager
from kv.kv_events import KVEventLog
from kv.transfer import KVExport, KVTransferError
from worker.api import KVImportError, LoRAAdapterError, LoRANotFoundError, RequestError
from worker.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from worker.engine.stats import EngineStats, engine_stats
from worker.kvcache.connector import KVConnector, make_connector
from worker.lora.engine_lora import EngineLoRA
from worker.api import RequestOutput, RunnerOutput
from worker.runner.protocols import Runner
from worker.api import SamplingParams
from worker.scheduling.scheduler import Scheduler, SchedulerOutput
from worker.engine.request_checks import RequestLimits, check_import_root, check_request
from worker.sequence import Sequence
from worker.sampling.thinking import ThinkingState
from worker.scheduling.step_budget import StepPredictor, engine_step_budget
from worker.engine.step_meters import OutputLengthTracker, PrefillRateMeter, StepCounters
from worker.engine.overlap import AppliedStep, LaunchedStep, overlaps
from worker.scheduling.async_scheduler import AsyncScheduler
from worker.scheduling.requests import Requests
from worker.spec.apply import num_step_tokens, prefill_rows
from worker.spec.drafts import Speculator
from worker.structured.compile_waits import CompileWaits

if TYPE_CHECKING:  # torch: a simulated-device engine never imports it
    from worker.kvcache.tiers import TierManager

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        runner: Runner,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        step_time_predictor: StepPredictor | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        if not isinstance(runner, Runner):
            raise TypeError(f"{type(runner).__name__} is not a runner (needs num_blocks and execute(plan))")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # The runner's KV groups (kv/kv_groups.py); a runner without any keeps one full group.
        self.kv = KVCacheManager(runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 getattr(runner, "kv_layout", None))
        if cache_config.session_kv_ttl_s > 0 and cache_config.enable_prefix_caching:
            # Sessions' finished turns keep their blocks (kv/retention.py); the simulator
            # swaps the clock for its virtual one.
            self.kv.enable_retention(cache_config.session_kv_ttl_s, cache_config.session_kv_max_share,
                                     time.monotonic)
        # Speculative decoding (worker/spec/) verifies drafts with the tokens of the step
        # before in hand: it runs the serial loop, never a step launched ahead.
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        # A runner that overlaps the device gets async scheduling (plans made and launched ahead).
        overlapped = overlaps(runner) and self.speculative is None
        self.scheduler = (AsyncScheduler if overlapped else Scheduler)(scheduler_config, self.kv)
        if self.speculative is not None:
            self.scheduler.speculator = Speculator(self.speculative, scheduler_config.max_model_len)
        self.scheduler.step_budget = engine_step_budget(scheduler_config.max_step_time_s, runner,
                                                           step_time_predictor)
        self.connector: KVConnector = make_connector(runner, self.kv, vocab_size)
        self.tiers: TierManager | None = None  # KV tiers below the device (use_tiers)
        self.kv_events: KVEventLog | None = None  # for the router's index (enable_kv_events)
        # The next step, launched by complete_step before it waited (worker/scheduling/async_scheduler.py).
        self._launched_ahead: LaunchedStep | None = None
        # Multi-LoRA (worker/lora/): set by from_config when the engine config enables it.
        self.lora: EngineLoRA | None = None
        self.model_path: Path | None = None  # set when built from a model directory
        self.counters = StepCounters()
        # For the routing-stats report (worker/serving/routing_report.py): observed output lengths,
        # and the prefill rate in device seconds (a sleeping simulated runner's dilation
        # divided out; real runners report device time already).
        self.output_lengths = OutputLengthTracker()
        self.prefill_meter = PrefillRateMeter(
            scheduler_config.max_num_batched_tokens, getattr(runner, "forward_time_dilation", 1.0))
        self.requests = Requests(self.scheduler, self.connector, self.output_lengths)

    @property
    def seqs(self) -> dict[str, Sequence]:
        """The engine's requests by id, from add_request to their last output."""
        return self.requests.seqs

    @property
    def compiles(self) -> CompileWaits:
        """Requests waiting on their grammar's compile (the compiler is set when the engine
        has a tokenizer: build_engine)."""
        return self.requests.compiles

    def enable_lora(self, lora: EngineLoRA) -> None:
        self.lora = self.requests.lora = lora
        self.scheduler.lora_slots = lora.slots
        self.runner.lora_adapters = lora.registry.get

    def use_tiers(self, tiers: TierManager) -> None:
        """Evicted prefix blocks move down into `tiers`, and come back from there
        (worker/kvcache/tiers.py draws the path)."""
        if self.kv.layout is not None and self.kv.layout.frees_blocks:
            raise ValueError(
                "host/disk KV tiers are not supported for an engine whose sliding-window layers release "
                f"blocks (KV layout: {self.kv.layout.describe()}); an engine built with "
                "cache.host_kv_cache_bytes set keeps one table of every layer instead")
        self.tiers = self.requests.tiers = tiers
        tiers.use_retention(self.kv.pool.retention)  # its evicted blocks stay apart in the host tier
        self.kv.pool.evicted = []
        if tiers.shared is not None:
            self.kv.pool.stored = []
        self.scheduler.tiers = tiers
        if self.kv_events is not None:
            tiers.use_events(self.kv_events)

    def enable_kv_events(self) -> KVEventLog:
        """Record what the KV cache and its tiers store, lose and move (kv/kv_events.py).
        The caller must drain the log (worker/kvcache/event_stream.py, every step): unread, it
        grows with every block cached."""
        if self.kv_events is None:
            self.kv_events = KVEventLog()
            self.kv.pool.events = self.kv_events
            if self.tiers is not None:
                self.tiers.use_events(self.kv_events)
        return self.kv_events

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, on the device and in the host and local-disk
        tiers (vLLM's reset_prefix_cache): running requests keep their blocks, which are no
        longer shared. Engine thread only."""
        self.kv.pool.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.clear()

    def unload_lora(self, name: str) -> bool:
        """Forget an adapter the ingress unloaded (EngineLoRA.unload). Engine thread only."""
        return self.lora.unload(name) if self.lora is not None else False

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    # -- requests ------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that could never be served."""
        check_request(prompt_token_ids, params, RequestLimits(
            self.vocab_size, self.max_model_len, self.kv.block_size, self.kv.num_total_blocks,
            constrains=self.compiles.compiler is not None,
            prompt_logprobs=getattr(self.runner, "supports_prompt_logprobs", False),
            blocks_needed=self._blocks_needed if self.kv.layout is not None and self.kv.layout.frees_blocks else None))

    def _blocks_needed(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most (every KV group's)."""
        return self.kv.max_blocks_for(num_tokens, self.scheduler_config.max_num_batched_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        export_kv: bool = False,
        kv_import: KVExport | None = None,
        prompt_block_hashes: list[int] | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        quiet: bool = False,
        num_resumed_tokens: int = 0,
        session_id: str | None = None,
    ) -> None:
        """`num_resumed_tokens`: the prompt's last tokens are output of an earlier attempt (a
        migrated request): a structured-output grammar starts past them.
        `quiet`: the caller reads the first output and the finished one only (a
        non-streamed response with nothing to watch per token): the steps between make no
        output, and each output carries every token since the one before.
        `export_kv`: when the first token is sampled, attach a KVExport of the prompt to
        that output (`extra["kv_export"]`) and pin its blocks until `release_kv`.
        `kv_import`: the prompt's KV computed elsewhere; the request continues after the
        export's first token (prompt + that token, the prompt already computed).
        `prompt_block_hashes`: the prompt's full-block hashes (kv.block_hash at this engine's
        block size) when the caller in this process has them already (the simulator).
        `lora_name`: the adapter that serves it (LoRANotFoundError if unknown); with
        `lora_path`, an adapter this engine learns if it does not know it yet.
        `session_id`: the client's session; with session KV retention
        (CacheConfig.session_kv_ttl_s) its finished turn's blocks are kept for the next."""
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if lora_name is not None:
            if self.lora is None:
                raise LoRANotFoundError(lora_name, [])
            self.lora.resolve(lora_name, lora_path)
        # An adapter changes every layer's K and V: its blocks chain from a root of their
        # own (router/routing/types.py request_hash_root hashes the same way).
        lora_root = root_hash((*params.cache_keys, self.lora.cache_key(lora_name))) if lora_name is not None else None
        try:
            self.connector.check_request(prompt_token_ids, params, export_kv, kv_import)
        except KVTransferError as e:
            raise KVImportError(str(e)) from None
        if kv_import is not None:
            check_import_root(kv_import, lora_root if lora_root is not None else root_hash(params.cache_keys))
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        seq.num_resumed_tokens = max(0, min(num_resumed_tokens, len(prompt_token_ids) - 1))
        seq.session_id = session_id
        if params.thinking is not None:  # a migrated request's earlier output counts as spent
            resumed = prompt_token_ids[len(prompt_token_ids) - seq.num_resumed_tokens:]
            seq.thinking = ThinkingState.replayed(params.thinking, resumed)
        if quiet and params.logprobs is None:  # per-token logprobs leave with each token's output
            seq.quiet_from = seq.num_prompt_tokens
        self.connector.add_request(seq, export_kv, kv_import)
        self.counters.num_arrived += 1
        self.counters.num_arrived_prompt_tokens += seq.num_prompt_tokens
        self.requests.seqs[request_id] = seq
        if lora_name is not None:
            seq.lora_name = lora_name
            seq.hash_root = lora_root
        elif prompt_block_hashes is not None:  # the manager copies them (it extends its list in place)
            self.kv.adopt_block_hashes(request_id, prompt_block_hashes)
        if lora_name is not None and not self.lora.add(seq):
            return  # waits for its adapter's host load (Requests.admit_ready admits it)
        self.requests.admit(seq)

    def check_lora(self, name: str, path: str, roots: tuple[str, ...] = ()) -> tuple[str, str]:
        """EngineLoRA.check, on any thread; LoRAAdapterError when this engine serves no adapters."""
        if self.lora is None:
            raise LoRAAdapterError("this server does not serve LoRA adapters (start it with engine.lora.enable "
                                   "or --lora-modules)")
        return self.lora.check(name, path, roots)

    # -- disaggregation: the connector's pins, as the async engine and replica see them -----
    def release_kv(self, request_id: str) -> bool:
        """The decode side has the request's KV (or gave up): unpin its blocks."""
        return self.connector.release_kv(request_id)

    def next_pin_deadline(self) -> float | None:
        return self.connector.next_pin_deadline()

    @property
    def num_pinned_blocks(self) -> int:
        return self.connector.num_pinned_blocks

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks (pinned exported ones too) are free when this returns."""
        return self.requests.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.requests.num_waiting_outside > 0

    # -- the iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run, apply, publish: one step, start to finish, on the calling thread."""
        step = self._plan_step()
        if step.plan.is_empty:
            self.wait_for_compiles()
            return step.outputs
        try:
            result = self.runner.execute(step.plan)
        except Exception as e:  # fail this step's requests, keep serving the rest
            return step.outputs + self._failed_step(step.plan, e)
        applied = self._apply(step, result)
        outputs = step.outputs + self.step_outputs(applied)
        self.counters.account(num_step_tokens(step.plan, applied.changed), time.perf_counter() - step.start_s,
                              result.forward_s)
        return outputs

    # The overlapped step (worker/scheduling/async_scheduler.py draws its timeline): launch_step, then
    # the previous step's step_outputs while the device works, then complete_step.
    @property
    def overlaps_device(self) -> bool:
        """Whether this engine's runner returns from a launch while the device works (never
        with speculative decoding, which steps serially)."""
        return overlaps(self.runner) and self.speculative is None

    @property
    def launches_ahead(self) -> bool:
        """Whether this engine's runner takes a plan whose inputs are the previous step's
        samples still on the device (worker/scheduling/async_scheduler.py)."""
        return self.overlaps_device and getattr(self.runner, "launches_ahead", False)

    def launch_step(self) -> LaunchedStep:
        """Plan the next step and start it on the device (returns while the device works).
        An empty plan launches nothing; a failed launch is reported by complete_step. A
        step complete_step launched ahead is already on the device, and is returned."""
        if self._launched_ahead is not None:
            step, self._launched_ahead = self._launched_ahead, None
            return step
        if self.speculative is not None:
            raise RuntimeError("speculative decoding runs the serial step loop (Engine.step): a step "
                               "overlapped or launched ahead cannot verify drafts")
        step = self._plan_step()
        if not step.plan.is_empty:
            try:
                step.handle = self.runner.launch(step.plan)
            except Exception as e:
                step.error = e
                return step
            # Under the device: what applying the step needs of the plan alone.
            self.counters.timed(self.scheduler.advance, step.plan)
        return step

    def complete_step(self, step: LaunchedStep) -> AppliedStep:
        """Wait for a launched step and apply its result (blocks freed, sequences
        advanced); its outputs are built later, by step_outputs."""
        if step.plan.is_empty:
            return AppliedStep(step.plan)
        ahead: LaunchedStep | None = None
        if step.error is None:
            # Still under the device: the next plan, if it can only be decodes. Not while
            # an export is due: its pin would hold the block grown ahead too.
            if not self.connector.exporting:
                self.counters.timed(self.scheduler.plan_ahead)
                if self.launches_ahead:
                    ahead = self._launch_ahead()
            try:
                result = self.runner.wait(step.handle)
            except Exception as e:
                step.error = e
        step_done_s = time.perf_counter()
        if step.error is not None:
            applied = AppliedStep(step.plan, failed=self._failed_step(step.plan, step.error))
        else:
            applied = self._apply(step, result)
            self.counters.account(len(applied.changed), time.perf_counter() - step.start_s, result.forward_s)
        if ahead is not None:
            if ahead.error is None:  # token_ids hold step N's tokens now (launch ahead's rules)
                self.counters.timed(self.scheduler.advance, ahead.plan)
            # Its step time counts from here, not from its launch: until step N was done
            # it waited on the device behind it.
            ahead.start_s = step_done_s
            self._launched_ahead = ahead
        return applied

    def _launch_ahead(self) -> LaunchedStep | None:
        """Launch the plan made ahead before the step on the device is waited for, when
        the steady state holds (worker/scheduling/async_scheduler.py); None leaves it to launch_step."""
        if self.requests.num_waiting_outside:
            return None
        tiers = self.tiers
        if tiers is not None and tiers.has_pending:
            return None
        plan = self.counters.timed(self.scheduler.launch_ahead)
        if plan is None:
            return None
        if tiers is not None:  # blocks evicted for the grown tables go down first
            tiers.offload(self.kv.pool.evicted)
        step = LaunchedStep(plan)  # complete_step sets start_s
        try:
            step.handle = self.runner.launch(plan)
        except Exception as e:
            step.error = e
        return step

    def step_outputs(self, applied: AppliedStep) -> list[RequestOutput]:
        """The RequestOutputs of an applied step (one per sequence that got a token)."""
        if applied.failed is not None:
            return applied.failed
        return self.requests.step_outputs(applied.plan, applied.logprobs, applied.changed, applied.saved)

    def wait_for_compiles(self) -> None:
        """Nothing to run but grammar compiles, adapter loads or tier reads: wait for one, briefly."""
        self.requests.wait_for_any()

    def _plan_step(self) -> LaunchedStep:
        start = time.perf_counter()
        self.connector.expire_pins()
        outputs = self.requests.admit_ready()  # compiles, adapter loads and disk reads done
        tiers = self.tiers
        plan = self.counters.timed(self.scheduler.schedule)
        if tiers is not None:  # evicted blocks down before this step overwrites them, then loads
            tiers.offload(self.kv.pool.evicted)
            if plan.kv_loads:
                self.requests.finish_tier_loads(tiers.start_loads(plan.kv_loads))
        outputs += self.requests.load_kv(plan)  # imports admitted this step: their KV into their blocks
        return LaunchedStep(plan, outputs, start_s=start)

    def _apply(self, step: LaunchedStep, result: RunnerOutput) -> AppliedStep:
        plan = step.plan
        budget = self.scheduler.step_budget
        if budget is not None and budget.corrected:  # before update moves num_computed_tokens
            budget.observe_plan(plan, result.token_ids, result.forward_s)
        saved = self.connector.save_kv(plan, result.token_ids)  # before update frees blocks
        verified = result.verified_token_ids if plan.draft_token_ids else None  # only verify rows carry them
        changed = self.counters.timed(self.scheduler.update, plan, result.token_ids, verified)
        if self.tiers is not None:  # blocks computed this step, out to the shared store
            self.tiers.publish(self.kv.pool.stored)
        self.prefill_meter.record(prefill_rows(plan), result.forward_s)
        return AppliedStep(plan, result.logprobs, changed, saved)

    def _failed_step(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        logger.error("engine step failed; failing %d requests", len(plan.seqs), exc_info=error)
        return self.requests.fail_step(plan, error)

    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        if self.tiers is not None:
            kv = replace(kv, **self.tiers.stats())
        speculator = self.scheduler.speculator
        return engine_stats(kv, self.scheduler, self.counters,
                            speculator.counters if speculator is not None else None)
