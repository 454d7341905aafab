"""Executes a scheduler plan as ONE flat token batch and samples the next tokens.

`execute(plan)` is `wait(launch(plan))`: launch queues the step on the device, wait reads
its samples (worker/scheduling/async_scheduler.py: on CUDA the engine works on the host in between; a
plan launched ahead takes its input tokens from the step before's samples on the device,
worker/scheduling/async_scheduler.py).

Per step: build the flat inputs (token ids, positions, KV slots, attention metadata) with
a handful of tensor ops, run the model over every token, compute logits only for the
last token of each sequence that samples, and sample the whole batch at once.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from collections.abc import Callable
from typing import Any

import torch

from kv.kv_cache import KVCacheSpec, allocate_kv_cache, gpu_kv_budget, num_blocks_for_budget
from worker.api import RunnerOutput
from worker.attention import select_backend
from worker.attention.kv_quant import kv_cache_dtype
from worker.config import EngineConfig
from worker.runner.cuda_graphs import GraphOutputs, capture_decode_graphs, cuda_graphs_off_reason
from worker.runner.forward_timer import ForwardTimer
from worker.runner.kv_group_binding import (
    bind_groups, gather_table, layer_caches, model_kv_layout, scatter_table,
)
from kv.kv_groups import full_layout
from worker.lora.model_lora import ModelLoRA, adapter_loader
from worker.runner.memory_profile import activation_peak_bytes
from worker.model.kv_geometry import attention_backend_name, is_latent, kv_cache_spec_for
from worker.model.loader import load_model
from worker.model.registry import arch_for
from worker.model_path import resolve_model_path
from worker.model.parallel import SINGLE, TPContext
from worker.sampling import prompt_logprobs
from worker.api import TokenLogprob
from worker.runner.batches import HostBatch, LaunchedBatch
from worker.runner.block_table import PersistentBlockTable
from worker.runner.lm_head import greedy_ids, head_logits
from worker.runner.inputs import DeviceInputs, attention_metadata, host_batch, staged_inputs
from worker.runner.staging import InputStaging
from worker.sampling.sampled_batch import SampledBatch
from worker.sampling.sampler import Sampler, argmax_only
from worker.spec.verify import launch_verify
from worker.structured.bitmask import MaskPrefetcher
from worker.scheduling.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU: fp32 (bf16 matmuls are slow on most CPUs); GPU: bf16.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} ({', '.join(_DTYPES)}, auto)")
    return _DTYPES[name]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: object, max_model_len: int, tp: TPContext = SINGLE
    ) -> None:
        """Under tensor parallelism every rank builds one of these (its shard of the model and
        a KV cache of its own kv heads); only rank 0 samples."""
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if config.model.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        self.arch = arch_for(hf_config)
        self.block_size = config.cache.block_size
        self.backend = select_backend(
            attention_backend_name(self.arch, config.model.attention_backend), self.device,
            needs_sinks=getattr(self.arch, "attention_sinks", False),
            needs_fp8_kv=config.cache.kv_cache_dtype == "fp8",
        )
        path = resolve_model_path(config.model.model)
        self.model = load_model(path, hf_config, self.backend, max_model_len, self.dtype, self.device, tp)
        # Multi-LoRA (worker/lora/): wrapped projections with device slots (allocated before the KV budget is taken); the engine sets
        # lora_adapters (name -> host copy) to fill the slots a plan lists.
        lora = config.lora
        if lora.enabled and getattr(self.model, "kept_quantized", None):
            raise ValueError(f"LoRA is not built over projections kept quantized ({self.model.kept_quantized} "
                             "weights on CUDA); serve this model with lora disabled")
        self.lora = ModelLoRA(self.model, lora.max_loras, lora.max_lora_rank) if lora.enabled else None
        self.lora_loader = adapter_loader(self.arch, lora.max_lora_rank, lora.max_adapter_bytes)
        self.lora_adapters: Callable[[str], Any] | None = None
        # Layers grouped by cache kind (kv/kv_groups.py): the KV tensor has one layer slot
        # per layer of a group, and each layer's attention reads its group's tables.
        self.kv_layout = model_kv_layout(self.arch)
        if self.kv_layout.frees_blocks and config.cache.host_kv_cache_bytes:
            # A tier block holds every layer's KV of its tokens: one group, nothing released.
            logger.warning("KV tiers are on: the sliding-window layers keep every block (no release), "
                           "one block table for all layers")
            self.kv_layout = full_layout(self.arch.num_layers)
        self._num_groups = self.kv_layout.num_groups
        bind_groups(self.model, self.kv_layout)
        # The cache's geometry is the model's (latent rows for MLA, K and V heads otherwise),
        # one layer slot per layer of a group.
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        if kv_dtype != self.dtype and is_latent(self.arch):
            raise ValueError("kv_cache_dtype=fp8 is not built for multi-head latent attention (DeepSeek-V3)")
        self.spec = replace(kv_cache_spec_for(self.arch, self.block_size, kv_dtype, tp),
                            num_layers=self.kv_layout.layers_per_group)
        self.num_blocks = self._num_blocks(max_model_len)
        use_graphs = cuda_graphs_off_reason(config.model.enable_cuda_graphs, self.device, self.backend,
                                            tp.size, self._num_groups) is None
        # With graphs, one scratch block past the pool's num_blocks takes the padded rows'
        # K/V (worker/runner/cuda_graphs.py); the block pool never hands it out.
        self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks + int(use_graphs), self.device)
        self._layer_caches = layer_caches(self.kv_caches, self.kv_layout)
        self._layer_caches_of = self.kv_caches  # a TP rank may re-allocate kv_caches
        self.sampler = Sampler(self.arch.vocab_size, self.device) if tp.rank == 0 else None
        # A model whose compute_logits can leave them in its dtype (worker/model/llama.py),
        # on one rank: greedy-only batches skip the fp32 upcast of the logits.
        self._logits_in_model_dtype = tp.size == 1 and "fp32" in inspect.signature(self.model.compute_logits).parameters
        self.masks = MaskPrefetcher(self.device)
        self.timer = ForwardTimer(self.device)
        self._in_flight: LaunchedBatch | None = None  # launched last, not yet waited for
        self.graphs = (capture_decode_graphs(self.model, self.kv_caches, self.arch.vocab_size,
                                             self._logits_in_model_dtype, config.scheduler.max_num_seqs,
                                             max_model_len, self.num_blocks, self.block_size, self.device)
                       if use_graphs else None)
        # Varlen backends read the block tables on the device: there they persist between
        # steps and take only new block ids (worker/runner/block_table.py). One rank: a TP
        # rank's mirror may rewrite a table in place (worker/tp/plan_codec.py).
        self.tables = (
            PersistentBlockTable(2 * config.scheduler.max_num_seqs, -(-max_model_len // self.block_size),
                                 self.device, fill_block=self.num_blocks if use_graphs else 0)
            if self.backend.varlen and self._num_groups == 1 and tp.size == 1 else None
        )
        # With them, a step's small inputs go up in one pinned copy per dtype.
        self.staging = InputStaging(self.device) if self.tables is not None else None

    # -- disaggregation: the engine moves a request's KV through these, never kv_caches --
    @property
    def kv_spec(self) -> KVCacheSpec:
        """The layout an export of this engine has (all of the model's KV heads, every layer
        in model order, whatever its KV groups)."""
        return replace(self.spec, num_layers=self.kv_layout.num_layers)

    @property
    def kv_bytes_per_block(self) -> int:
        """One pool block on this rank (every layer slot of a KV group)."""
        return self.spec.bytes_per_block

    def export_kv(self, block_ids: list[int] | list[list[int]]) -> torch.Tensor:
        """The KV of a table (one id list, or one per KV group) in model layer order."""
        return gather_table(self.kv_caches, self.kv_layout, block_ids)

    def import_kv(self, block_ids: list[int] | list[list[int]], kv: torch.Tensor) -> None:
        scatter_table(self.kv_caches, self.kv_layout, block_ids, kv)

    def _num_blocks(self, max_model_len: int) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type != "cuda":
            return num_blocks_for_budget(self.spec, cache.kv_cache_bytes)
        sched = self.config.scheduler
        peak = activation_peak_bytes(
            self.model, self.spec, sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len,
            self.device, self.backend.varlen,
        )
        budget = gpu_kv_budget(self.device, cache.gpu_memory_utilization, peak)
        logger.info("KV budget %.2f GiB (profile forward peak %.2f GiB, gpu_memory_utilization %.2f)",
                    budget / 2**30, peak / 2**30, cache.gpu_memory_utilization)
        return num_blocks_for_budget(self.spec, budget)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.wait(self.launch(plan))

    # -- the step split at the device (worker/scheduling/async_scheduler.py) -------------------------------
    @property
    def overlaps_device(self) -> bool:
        """On CUDA, launch returns with the forward queued on the stream and the host is
        free until wait's sync; on a CPU device launch computes the forward itself."""
        return self.device.type == "cuda"

    @property
    def launches_ahead(self) -> bool:
        """On CUDA, one rank: a plan's pending input tokens are gathered on the device from
        the samples of the step launched before it (worker/scheduling/async_scheduler.py). Under TP the
        other ranks would need those ids too."""
        return self.overlaps_device and self.tp.size == 1

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> LaunchedBatch:
        """Inputs, the forward and the logits, queued on the device; no host sync (prompt
        logprobs aside). A plan launched ahead first queues the sampling of the step before
        it, whose ids are its inputs."""
        before = self._sample_in_flight() if plan.pending_inputs else None
        # Decodes (1 query token) first, shortest context first (see worker/runner/decode_groups.py).
        num_new, seqs = plan.num_new_tokens, plan.seqs
        order = sorted(
            range(len(seqs)),
            key=lambda i: (num_new[i] != 1, seqs[i].num_computed_tokens if num_new[i] == 1 else 0),
        )
        batch = host_batch(plan, order, self.block_size, self._num_groups, self.tables)
        if before is not None:
            batch.input_ids = self._pending_inputs(plan, order, before)
        if self.lora is not None:
            self._prepare_lora(plan, order, batch)
        staged = staged_inputs(batch, self.staging) if self.staging is not None else None
        last_token_idx = (staged.last_token_idx if staged is not None else
                          torch.tensor(batch.last_token_idx, dtype=torch.long).to(self.device, non_blocking=True))
        # Structured outputs: on an accelerator the grammar masks are computed while the
        # forward runs (on a CPU device the sampler computes them: worker/structured/bitmask.py).
        sampling = [plan.seqs[i] for i in batch.sample_rows]
        masks = self.masks.start(sampling, self.arch.vocab_size) if self.sampler is not None else None
        hidden, replayed = self._forward(batch, staged)
        if self.supports_prompt_logprobs:
            self._prompt_logprobs(plan, order, batch, hidden)
        sample_rows = batch.sample_rows
        if batch.draft_rows and self.sampler is not None:
            return self._launch_verify(plan, batch, hidden, masks)
        if not sample_rows or self.sampler is None:
            if sample_rows:  # a TP rank other than 0: it only joins the collectives
                self.model.compute_logits(hidden[last_token_idx])
            self.timer.stop()
            return LaunchedBatch(plan, [], None, None)
        greedy = argmax_only(sampling)
        ids: torch.Tensor | None = None
        if replayed is not None and len(sample_rows) == len(order):  # row r samples from flat token r
            logits, ids = replayed.logits, replayed.greedy_ids
        else:  # model dtype for a greedy batch: no fp32 copy of (rows, V)
            logits = head_logits(self.model.compute_logits, hidden[last_token_idx],
                                 self._logits_in_model_dtype and greedy)
        self.timer.stop()
        launched = LaunchedBatch(plan, sample_rows, logits, masks)
        if greedy:  # a plain argmax: no sampler (worker/runner/lm_head.py)
            if ids is None:
                ids = greedy_ids(logits, self.arch.vocab_size)
            launched.sampled = SampledBatch(ids, ids, None, sampling, [])
        self._in_flight = launched
        return launched

    def _launch_verify(self, plan: SchedulerOutput, batch: HostBatch, hidden: torch.Tensor,
                       masks: Any) -> LaunchedBatch:
        """A step with verify rows (speculative decoding, worker/spec/): one LM head call over
        the sampling rows' last tokens and every verify position; the sampler takes the
        first, the verifier the rest."""
        assert self.sampler is not None
        positions = [q + j for _, q, k in batch.draft_rows for j in range(k + 1)]
        index = torch.tensor(batch.last_token_idx + positions, dtype=torch.long).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[index])
        self.timer.stop()
        num_sampled = len(batch.sample_rows)
        rows = [i for i, _, _ in batch.draft_rows]
        verify = launch_verify(logits[num_sampled:], [plan.seqs[i] for i in rows], rows,
                               [plan.draft_token_ids[plan.seqs[i].request_id] for i in rows], self.sampler)
        launched = LaunchedBatch(plan, batch.sample_rows, logits[:num_sampled] if num_sampled else None, masks,
                                 verify=verify)
        self._in_flight = launched
        return launched

    def _sample_in_flight(self) -> LaunchedBatch:
        """The step launched last, its sampling queued now (it has not been waited for)."""
        before = self._in_flight
        if before is None or before.logits is None:
            raise RuntimeError("a plan launched ahead needs the step before it still on the device")
        if before.sampled is None:  # a greedy batch's ids were taken at its launch
            before.sampled = self._sample(before)
        return before

    def _pending_inputs(self, plan: SchedulerOutput, order: list[int], before: LaunchedBatch) -> torch.Tensor:
        """The input ids of a plan launched ahead, in execution order: row r's is the token
        the step before sampled for the same sequence, gathered on the device.

            before.sample_rows[j] = i  ->  before.sampled.token_ids[j] is seqs[i]'s token
        """
        assert before.sampled is not None
        row_of = {before.plan.seqs[i].request_id: j for j, i in enumerate(before.sample_rows)}
        index = torch.tensor([row_of[plan.seqs[i].request_id] for i in order], dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory()
        return before.sampled.token_ids.index_select(0, index.to(self.device, non_blocking=True))

    def _sample(self, launched: LaunchedBatch) -> SampledBatch:
        assert self.sampler is not None and launched.logits is not None
        masks = launched.masks
        return self.sampler.launch(
            launched.logits, [launched.plan.seqs[i] for i in launched.sample_rows],
            masks.result() if masks is not None else None,
        )

    def _prepare_lora(self, plan: SchedulerOutput, order: list[int], batch: HostBatch) -> None:
        """Write the adapters newly given slots, then map this step's rows to slots. On the
        device's stream, a write follows the steps queued before it (none of which uses a
        slot being rewritten: the scheduler rewrites only slots no running sequence holds)."""
        assert self.lora is not None and self.lora_adapters is not None
        for slot, name in plan.lora_loads:
            self.lora.write_slot(slot, self.lora_adapters(name))
        self.lora.prepare([plan.seqs[i].lora_slot for i in order], batch.lens, self.device, self.dtype)

    @torch.inference_mode()
    def wait(self, launched: LaunchedBatch) -> RunnerOutput:
        """Sample the launched step's logits: the step's one host sync (the sampled ids;
        the timer's events complete before it)."""
        plan = launched.plan
        token_ids: list[int | None] = [None] * len(plan.seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(plan.seqs)
        if self._in_flight is launched:
            self._in_flight = None
        if launched.logits is not None:
            # launch leaves logits only on the rank that samples
            sampled = (launched.sampled or self._sample(launched)).result()
            for row, i in enumerate(launched.sample_rows):
                token_ids[i] = sampled.token_ids[row]
                logprobs[i] = sampled.logprobs[row]
        if launched.verify is None:
            return RunnerOutput(token_ids, logprobs, self.timer.elapsed_s())
        verified = launched.verify.result()
        for i, tokens in verified.items():
            token_ids[i] = tokens[0]
        return RunnerOutput(token_ids, logprobs, self.timer.elapsed_s(), verified)

    @property
    def supports_prompt_logprobs(self) -> bool:
        """The engine refuses prompt_logprobs where this is False: under TP the extra
        lm_head call would be a collective the other ranks do not know to join."""
        return self.tp.size == 1

    def _prompt_logprobs(self, plan: SchedulerOutput, order: list[int], batch: HostBatch, hidden: torch.Tensor) -> None:
        rows = prompt_logprobs.rows_for_step(plan.seqs, plan.num_new_tokens, order, batch.query_start)
        if rows is not None:
            prompt_logprobs.compute(rows, plan.seqs, hidden, self.model.compute_logits, self.arch.vocab_size)

    def _forward(self, batch: HostBatch, staged: DeviceInputs | None = None) -> tuple[torch.Tensor, GraphOutputs | None]:
        """Hidden states of every flat token, and the replay's outputs (LM head and greedy
        ids included) when a decode-only step fit a captured graph; the eager model and
        None otherwise. Starts the forward timer (the metadata built before it is host
        work, not forward time)."""
        num_seqs = len(batch.lens)
        # Graphs hold the base model only (captured with no adapter rows).
        no_lora = self.lora is None or self.lora.state.num_active == 0
        table = batch.device_table if batch.device_table is not None else batch.block_table
        assert table is not None
        if self.graphs is not None and no_lora and batch.num_decodes == num_seqs and self.graphs.fits(num_seqs, table.shape[1]):
            self.timer.start()
            if staged is not None:
                out = self.graphs.run(staged.input_ids, staged.positions, staged.meta.slot_mapping, table,
                                      staged.context_lens)
            else:
                out = self.graphs.run(batch.input_ids, batch.positions, batch.slot_mapping, table, batch.context_lens)
            return out.hidden, out
        dev = self.device
        if staged is not None:
            meta, input_ids, positions = staged.meta, staged.input_ids, staged.positions
        else:
            meta = attention_metadata(batch, self.block_size, self._num_groups, self.device, self.backend.varlen)
            input_ids = batch.input_ids.to(dev, non_blocking=True)
            positions = batch.positions.to(dev, non_blocking=True)
        self.timer.start()
        # One group: the tensor itself; several: each layer's slot view.
        if self._layer_caches_of is not self.kv_caches:
            self._layer_caches = layer_caches(self.kv_caches, self.kv_layout)
            self._layer_caches_of = self.kv_caches
        caches = self._layer_caches
        return self.model(input_ids, positions, caches, meta), None
